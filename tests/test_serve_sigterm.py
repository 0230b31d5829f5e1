"""Every role of ``pdflow serve`` stops cleanly on SIGTERM: exit 0, "stopped" printed, and
no process of its group left behind (its rank processes, the zygote). The P/D instances
are stopped after they served a request through the router, so their pairs, listener
threads and Mooncake engines were live; decode runs TP2, so it has rank processes.
Decode instances were seen dying of SIGABRT here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_pd_separate import ENV, SPEC, _url_of

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

TP2_DECODE = [*[o for o in SPEC if not o.startswith("decode=")], "decode=tp2"]


def _start(*overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", "serve.port=0", *TP2_DECODE, *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def _terminate(proc: subprocess.Popen, role: str, *, group: bool) -> None:
    """SIGTERM to the server alone, or to its whole process group (its rank processes too,
    as a service manager stopping a control group does): exit 0, and its group empty soon
    after."""
    assert proc.poll() is None, f"{role} ended before SIGTERM"
    pgid = proc.pid
    if group:
        os.killpg(pgid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"{role} did not stop within 90 s of SIGTERM:\n{out[-4000:]}") from None
    assert proc.returncode == 0, f"{role} exited {proc.returncode}:\n{out[-4000:]}"
    assert "pdflow serve: stopped" in out, out[-4000:]
    deadline = time.monotonic() + 10
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _group(pgid)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    assert not left, f"{role} left processes of its group behind: {left}"


def _kill_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


def _complete(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "The vault code of", "max_tokens": 3,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize("group", [False, True], ids=["server", "group"])
def test_every_separately_started_role_exits_0_on_sigterm(group):
    """Decode first, while its producer and the router still hold connections to it."""
    procs = []
    try:
        decode = _start("role=decode")
        procs.append(decode)
        prefill = _start("role=prefill")
        procs.append(prefill)
        decode_url, prefill_url = _url_of(decode), _url_of(prefill)
        router = _start("role=router", f"serve.prefill=[{prefill_url}]", f"serve.decode=[{decode_url}]")
        procs.append(router)
        _complete(_url_of(router))  # paired, transferred, decoded
        for proc, role in ((decode, "decode"), (prefill, "prefill"), (router, "router")):
            _terminate(proc, role, group=group)
    finally:
        _kill_all(procs)


@pytest.mark.parametrize("group", [False, True], ids=["server", "group"])
def test_the_default_deployment_exits_0_on_sigterm(group):
    proc = _start()
    try:
        _complete(_url_of(proc))
        _terminate(proc, "the default deployment", group=group)
    finally:
        _kill_all([proc])
