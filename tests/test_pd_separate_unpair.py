"""A prefill instance lets go of decode instances that are gone: its ranks' peers of a
consumer (sockets, registered host staging) and its endpoints do not outlive it.

Real processes on loopback (``pdflow serve role=prefill|decode``, Mooncake over TCP),
each request sent to a decode instance with the header naming the prefill instance (what
a router sends). A decode instance stopped with SIGTERM tells the prefill instance on
its way out (``POST /pdflow/unpair``); one killed with SIGKILL while its KV is in flight
is forgotten when that transfer fails. Either way ``pdflow_kv_paired_consumers`` drops to
0, ``/pdflow/instance`` lists no consumer, and the next decode instance pairs and serves
the same greedy tokens. Without the forget the gauge stays at 1 (the peers leak).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from bench_load import sample, scrape
from test_pd_separate import ENV, _stop, _url_of
from test_pd_separate_faults import _holding, _wait_for

from pdflow.serve.pd_wire import PREFILL_HEADER
from pdflow.worker.faults import ENV as FAULT_ENV
from pdflow.worker.faults import RELEASE_ENV

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

SPEC = ["prefill=tp1", "decode=tp1", "drafter=none", "tracking=off", "model.max_model_len=96",
        "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.num_kv_blocks=24", "decode.num_kv_blocks=24", "transfer.timeout_s=20"]
PROMPT = [7, 8, 9, 10, 11, 12, 13]
LONG = list(range(4, 84))  # 80 tokens: its transfer is easy to catch held
GAUGE = "pdflow_kv_paired_consumers"


def _start(role: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", "serve.port=0", f"role={role}", *SPEC],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or ENV,
                            start_new_session=True)


class DecodeInstance:
    """A decode instance this test starts and stops (its consumer id, as it pairs under)."""

    def __init__(self):
        self.proc = _start("decode")
        self.url = _url_of(self.proc)
        self.consumer_id = httpx.get(self.url + "/pdflow/instance", timeout=10).json()["consumer_id"]

    def complete(self, prefill: str, prompt: list[int], *, timeout: float = 120) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        return httpx.post(self.url + "/v1/completions", json=body, headers={PREFILL_HEADER: prefill},
                          timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        _stop(self.proc)


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    """One prefill instance for the module; its export can be held (``release`` absent)."""
    release = tmp_path_factory.mktemp("hold") / "release"
    release.touch()
    proc = _start("prefill", env={**ENV, FAULT_ENV: "export:prefill:0:hold", RELEASE_ENV: str(release)})
    try:
        yield {"url": _url_of(proc), "release": release}
    finally:
        release.touch()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        _stop(proc)


@pytest.fixture
def decodes():
    started: list[DecodeInstance] = []

    def start() -> DecodeInstance:
        started.append(DecodeInstance())
        return started[-1]

    try:
        yield start
    finally:
        for d in started:
            d.stop()


def _paired(url: str) -> tuple[float, list[str]]:
    """The prefill instance's gauge and the consumers ``/pdflow/instance`` lists."""
    m = scrape(url)
    assert (GAUGE, ()) in m, f"{url} has no {GAUGE}"
    return sample(m, GAUGE), httpx.get(url + "/pdflow/instance", timeout=10).json()["paired_consumers"]


def _forgotten(url: str, timeout_s: float = 60) -> tuple[float, list[str]]:
    """What the prefill instance holds once it holds no consumer (or at the bounded wait's end)."""
    deadline = time.monotonic() + timeout_s
    while (held := _paired(url))[0] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def _served(d: DecodeInstance, prefill: str) -> str:
    r = d.complete(prefill, PROMPT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    return r.json()["choices"][0]["text"]


def _lost(d: DecodeInstance, prefill: str) -> None:
    with contextlib.suppress(httpx.HTTPError):  # its decode instance is killed under it
        d.complete(prefill, LONG)


def _prefills(url: str) -> int:
    return httpx.get(url + "/pdflow/instance", timeout=10).json()["prefills"]


def test_a_decode_instance_stopped_with_sigterm_is_forgotten_and_the_next_pairs(prefill, decodes):
    url = prefill["url"]
    assert _forgotten(url) == (0, [])
    first = decodes()
    before = _prefills(url)
    text = _served(first, url)
    assert _prefills(url) == before + 1  # the prefill instance did prefill it
    assert _paired(url) == (1, [first.consumer_id])
    os.killpg(first.proc.pid, signal.SIGTERM)
    assert first.proc.wait(60) == 0
    assert _forgotten(url) == (0, [])  # told on its way out: its peers are closed
    assert first.consumer_id not in httpx.get(url + "/pdflow/instance", timeout=10).json()["pairings"]
    second = decodes()
    assert _served(second, url) == text
    assert _paired(url) == (1, [second.consumer_id])


def test_a_decode_instance_killed_while_its_kv_is_in_flight_is_forgotten(prefill, decodes):
    url, release = prefill["url"], prefill["release"]
    assert _forgotten(url) == (0, [])  # the last test's decode instances stopped with SIGTERM
    doomed = decodes()
    text = _served(doomed, url)
    assert _paired(url) == (1, [doomed.consumer_id])
    release.unlink()
    try:
        request = threading.Thread(target=_lost, args=(doomed, url), daemon=True)
        request.start()
        _wait_for(lambda: _holding(url))
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(30)
    finally:
        release.touch()  # the prefill instance now writes to a consumer that is gone
    request.join(120)
    assert not request.is_alive(), "the request to the killed decode instance hung"
    assert _forgotten(url) == (0, [])  # the failed transfer let its peers go
    after = decodes()
    assert _served(after, url) == text
    assert _paired(url) == (1, [after.consumer_id])
