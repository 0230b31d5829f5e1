"""Building a C++ op with torch's ``load_inline`` so that a killed build or a second
environment cannot break the next one.

Why: torch guards a JIT build folder with a lock *file* (``FileBaton``) that an interrupted
build leaves behind, and every later load then waits on it forever, silently. Its default
folder is named by python and accelerator only, so two environments with different torch
installs rebuild over each other. Here the folder name carries the torch install
(version, package path) and the python ABI, and builds are serialised by an ``fcntl``
lock, which the kernel drops when its holder dies: whoever holds it knows that a
``FileBaton`` lock still in the folder was left by a dead build, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

# torch's FileBaton lock file inside the build folder, and ours beside it.
BATON_FILE = "lock"
FLOCK_FILE = "pdflow.flock"
# How long to wait on a live build by another process before falling back, and when to
# say that we are waiting.
WAIT_S = float(os.environ.get("PDFLOW_BUILD_WAIT_S", "900"))
SAY_WAITING_AFTER_S = 10.0
# A file to append compile events to (JSON lines: event, what, pid, time), for tests that
# check where builds and warm-ups happen across processes; unset, nothing is written.
COMPILE_LOG_ENV = "PDFLOW_COMPILE_LOG"


def python_tag() -> str:
    """The ABI a built module is tied to, e.g. ``cpython-311``."""
    return f"{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"


def install_tag(torch_version: str, torch_path: str, python: str) -> str:
    """Names one torch install: readable version and python, plus a hash of the path (two
    venvs with their own torch of the same version still get different folders)."""
    digest = hashlib.sha1(f"{torch_version}|{os.path.realpath(torch_path)}|{python}".encode())
    return f"{python}_torch{torch_version}_{digest.hexdigest()[:10]}"


def build_directory(
    name: str,
    *,
    root: str | None = None,
    torch_version: str = torch.__version__,
    torch_path: str = os.path.dirname(torch.__file__),
    python: str | None = None,
) -> Path:
    """``<root>/<install tag>/<name>``; root is ``TORCH_EXTENSIONS_DIR`` or torch's cache."""
    if root is None:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root) / install_tag(torch_version, torch_path, python or python_tag()) / name


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def log_event(event: str, *, what: str = "") -> None:
    """Append one event to ``$PDFLOW_COMPILE_LOG`` when it is set (one short write in
    append mode: lines of several processes do not interleave)."""
    path = os.environ.get(COMPILE_LOG_ENV)
    if not path:
        return
    line = json.dumps({"event": event, "what": what, "pid": os.getpid(), "time": time.time()})
    with open(path, "a") as f:
        f.write(line + "\n")


@contextlib.contextmanager
def build_lock(folder: Path, *, wait_s: float = WAIT_S, what: str = "a C++ op") -> Iterator[None]:
    """Hold ``folder``'s build lock (waiting at most ``wait_s`` for a live holder, else
    TimeoutError); a FileBaton lock found once it is held is stale and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / FLOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        began = time.monotonic()
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - began
                if waited > wait_s:
                    raise TimeoutError(
                        f"another process has been building {what} in {folder} for over "
                        f"{wait_s:.0f}s (PDFLOW_BUILD_WAIT_S)"
                    ) from None
                if waited > SAY_WAITING_AFTER_S and not said:
                    say(f"pdflow: waiting for another process compiling {what} in {folder}...")
                    said = True
                time.sleep(0.2)
        (folder / BATON_FILE).unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def load_inline_op(
    module: str, *, folder: Path, what: str, source: str, functions: list[str],
    cflags: list[str], ldflags: list[str],
):
    """``load_inline`` into ``folder`` under its build lock, announcing a first build."""
    from torch.utils.cpp_extension import load_inline

    with build_lock(folder, what=what):
        built = (folder / f"{module}.so").exists()
        if not built:
            say(f"pdflow: compiling {what} (first use, ~1 min; cached in {folder})...")
        log_event("load" if built else "build", what=what)
        return load_inline(
            module, cpp_sources=source, functions=functions, extra_cflags=cflags,
            extra_ldflags=ldflags, build_directory=str(folder),
        )
