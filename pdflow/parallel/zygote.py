"""A warm parent for rank processes: ``python -m pdflow.parallel.zygote``.

Why: a fresh rank interpreter spends seconds importing torch and pdflow before it does
anything (3.5 s of CPU each on a small VM: 14 s of wall time to start a PP4 -> TP4 pair on
two cores). The zygote is itself a fresh interpreter that imports them once, then forks
each rank on request. A forked rank is what ``rank_entry`` would have been: it imports only
pdflow and its target (never the user's main module), takes the owner's environment,
working directory and stdio at the time of the request, and runs ``rank_entry.run``.

The zygote never touches CUDA or runs a torch op (fork after either is unsafe); it exits
when its owner's socket closes, and its ranks exit when it does (they watch their parent).
``PDFLOW_RANK_START=spawn`` starts every rank as its own interpreter instead.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass

MAX_REQUEST_BYTES = 1 << 20
PRELOAD = ("torch", "torch.distributed")


@dataclass(kw_only=True, slots=True)
class ForkRank:
    """Fork one rank; sent with three descriptors: its socket to the owner, stdout, stderr."""

    label: str
    target_module: str  # imported in the zygote first, so later ranks get it warm
    environ: dict[str, str]
    cwd: str
    sys_path: list[str]


@dataclass(kw_only=True, slots=True)
class ExitStatus:
    """Ask for a forked rank's exit status (None while it runs)."""

    pid: int


class Zygote:
    """The owner's handle on its zygote process; thread-safe, one request at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            fd = theirs.fileno()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdflow.parallel.zygote", "--fd", str(fd)],
                pass_fds=(fd,), stdin=subprocess.DEVNULL,
            )
        self._sock = ours
        self._lock = threading.Lock()
        self.owner_pid = os.getpid()

    def _ask(self, request, fds: list[int] = ()):
        with self._lock:
            socket.send_fds(self._sock, [pickle.dumps(request)], list(fds))
            size = struct.unpack("!I", _recv_exactly(self._sock, 4))[0]
            answer = pickle.loads(_recv_exactly(self._sock, size))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def fork(self, request: ForkRank, rank_fd: int) -> int:
        """The forked rank's pid; it writes to this process's stdout and stderr (fds 1, 2)."""
        return self._ask(request, [rank_fd, 1, 2])

    def exit_status(self, pid: int) -> int | None:
        """Like ``Popen.poll``'s code (negative: killed by that signal) once it exited."""
        return self._ask(ExitStatus(pid=pid))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)


class ForkedRank:
    """A forked rank as the launcher sees it: ``subprocess.Popen``'s pid/poll/wait/terminate/
    kill, through a pidfd (the rank is the zygote's child, not ours)."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self._zygote = pid, zygote
        self._pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            code = None
            with contextlib.suppress(ConnectionError, OSError):
                code = self._zygote.exit_status(self.pid)
            self.returncode = -signal.SIGKILL if code is None else code  # zygote gone: it took us down
            os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def usable() -> bool:
    """Fork-from-zygote needs Linux's pidfds and descriptor passing; opt out with
    ``PDFLOW_RANK_START=spawn``."""
    return (os.environ.get("PDFLOW_RANK_START", "zygote") != "spawn" and hasattr(os, "pidfd_open")
            and hasattr(socket, "send_fds") and hasattr(signal, "pidfd_send_signal"))


def fork_rank(request: ForkRank, rank_fd: int) -> ForkedRank:
    """Fork a rank from this process's zygote (started on first use, shared by every
    instance this process owns, restarted if it died or this process was forked)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive() or _shared.owner_pid != os.getpid():
            _shared = Zygote()
            atexit.register(_shared.close)
        zygote = _shared
    return ForkedRank(zygote.fork(request, rank_fd), zygote)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the rank zygote exited")
        buf += chunk
    return buf


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class _Server:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.exited: dict[int, int] = {}
        self.children: set[int] = set()

    def _reap(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.children.discard(pid)
                    self.exited[pid] = _code(status)

    def _answer(self, value) -> None:
        data = pickle.dumps(value)
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def serve(self) -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_REQUEST_BYTES, 3)
            except OSError:
                return
            if not msg:  # the owner is gone
                return
            self._reap()
            request = pickle.loads(msg)
            if isinstance(request, ExitStatus):
                self._answer(self.exited.pop(request.pid, None) if request.pid not in self.children else None)
                continue
            try:
                self._answer(self._fork(request, fds))
            except Exception as err:  # noqa: BLE001 - reported to the owner, which raises it
                self._answer(RuntimeError(f"the rank zygote could not serve {request!r}: {err}"))
            finally:
                for fd in fds:
                    os.close(fd)

    def _fork(self, request: ForkRank, fds: list[int]) -> int:
        sys.path[:] = list(dict.fromkeys([*sys.path, *request.sys_path]))
        with contextlib.suppress(Exception):  # the rank imports it again and reports the error
            importlib.import_module(request.target_module)
        pid = os.fork()
        if pid:
            self.children.add(pid)
            return pid
        self._become_rank(request, fds)  # never returns

    def _become_rank(self, request: ForkRank, fds: list[int]) -> None:
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.sock.close()
            rank_fd, out, err = fds
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.chdir(request.cwd)
            os.environ.clear()
            os.environ.update(request.environ)
            from pdflow.parallel import rank_entry

            rank_entry.run(fd=rank_fd, parent=os.getppid(), label=request.label)
        finally:
            os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdflow-rank-zygote", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="inherited socket to the owner")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the owner, which shuts ranks down
    for name in PRELOAD:
        importlib.import_module(name)
    _Server(socket.socket(fileno=args.fd)).serve()


if __name__ == "__main__":
    # Run the imported module's copy, so requests unpickle to the classes ``serve`` checks.
    from pdflow.parallel import zygote

    zygote.main()
