"""The CPU decode op's first-use build: a build killed midway cannot hang the next load,
two torch installs never share a build folder, and a first build says so on stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pdflow.attention import jit_build

LOAD_OP = "from pdflow.attention import cpu_decode; assert cpu_decode.op() is not None"


def test_build_folder_depends_on_the_torch_install_and_python():
    base = dict(root="/cache", torch_version="2.13.0+cpu", torch_path="/venv-a/torch", python="cpython-311")
    folder = jit_build.build_directory("op_abc", **base)
    assert folder == jit_build.build_directory("op_abc", **base)
    assert folder.name == "op_abc" and "2.13.0+cpu" in folder.parent.name
    for change in ({"torch_path": "/venv-b/torch"}, {"torch_version": "2.12.0+cpu"},
                   {"python": "cpython-312"}):
        assert jit_build.build_directory("op_abc", **{**base, **change}) != folder, change


def test_build_folder_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert jit_build.build_directory("op_abc").parent.parent == tmp_path


def _hold_lock(folder) -> subprocess.Popen:
    """A builder that takes the lock, leaves torch's baton file, and stays alive."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pdflow.attention import jit_build
        folder = Path({str(folder)!r})
        with jit_build.build_lock(folder):
            (folder / jit_build.BATON_FILE).touch()
            print("held", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_waits_for_a_live_builder_and_breaks_a_dead_ones_baton(tmp_path):
    folder = tmp_path / "op"
    builder = _hold_lock(folder)
    try:
        with pytest.raises(TimeoutError, match="another process"), \
                jit_build.build_lock(folder, wait_s=0.5):
            pass
        assert (folder / jit_build.BATON_FILE).exists()  # a live build's baton is left alone
        os.kill(builder.pid, signal.SIGKILL)  # killed mid-build: its baton stays behind
        builder.wait(timeout=10)
        assert (folder / jit_build.BATON_FILE).exists()
        began = time.monotonic()
        with jit_build.build_lock(folder, wait_s=30):
            assert not (folder / jit_build.BATON_FILE).exists()
        assert time.monotonic() - began < 5
    finally:
        builder.kill()
        builder.wait(timeout=10)


def _load(env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD_OP], env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_stale_baton_from_a_killed_build_does_not_hang_the_next_load(tmp_path, monkeypatch):
    """torch's own FileBaton left in the op's folder (a build killed after taking it)
    would make load_inline wait forever; the load builds, announces it once, and the
    next load is silent."""
    if os.environ.get("PDFLOW_CPU_KERNELS", "1") == "0":
        pytest.skip("PDFLOW_CPU_KERNELS=0 turns the CPU decode op off")
    from pdflow.attention import cpu_decode

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_decode.build_folder()
    folder.mkdir(parents=True)
    os.close(os.open(folder / jit_build.BATON_FILE, os.O_CREAT | os.O_EXCL))  # as FileBaton does
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = _load(env)
    if first.returncode and not os.environ.get("CI") and "unavailable" in first.stderr:
        pytest.skip(f"the op does not build here: {first.stderr[-500:]}")
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("compiling the CPU decode op") == 1, first.stderr
    assert not (folder / jit_build.BATON_FILE).exists()
    second = _load(env)
    assert second.returncode == 0 and "compiling" not in second.stderr, second.stderr
