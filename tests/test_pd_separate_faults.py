"""Separately started P/D instances (``pdflow serve role=prefill|decode`` behind
``role=router`` processes, loopback, real Mooncake over TCP) get the faults
``test_reliability_faults`` gives ``Deployment``, and honour every serve option.

One prefill instance feeds two decode instances, each behind a router of its own: ``a``
with the default options, ``b`` with ``request_timeout_s`` and ``max_queued_requests=0``.
The prefill instance's export can be held (``PDFLOW_TEST_FAULT=...:hold`` until a file
exists), so a request is known to be mid-transfer without a clock. Each fault ends its
request with an OpenAI error body (never a hang), the survivors' free KV blocks come back
to their pool size, and a survivor serves the next request. The tests run in file order:
the last two kill instances.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest
from bench_load import sample, scrape
from test_pd_separate import ENV, _stop, _url_of

from pdflow.worker.faults import ENV as FAULT_ENV
from pdflow.worker.faults import RELEASE_ENV

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

MODEL = "tiny"
TIMEOUT_S = 8.0  # decode b's request_timeout_s: far above a tiny request, far below the hold's limit
SPEC = ["prefill=tp1", "decode=tp1", "tracking=off", "model.max_model_len=96", "prefill.block_size=16",
        "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.num_kv_blocks=24", "decode.num_kv_blocks=24", "transfer.timeout_s=20",
        "serve.max_body_bytes=65536"]  # the drafter is the default one: its counts are checked
LONG = list(range(4, 84))  # 80 tokens: 6 of a decode pool's 24 blocks


def _start(*overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", "serve.port=0", *SPEC, *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or ENV,
                            start_new_session=True)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    release = tmp_path_factory.mktemp("hold") / "release"
    release.touch()  # exports pass until a test removes it
    held_env = {**ENV, FAULT_ENV: "export:prefill:0:hold", RELEASE_ENV: str(release)}
    procs = {}
    try:
        # a queued remote prefill outlives every wait below unless its consumer drops it
        procs["prefill"] = _start("role=prefill", "serve.queue_timeout_s=200", env=held_env)
        procs["a"] = _start("role=decode")
        procs["b"] = _start("role=decode", f"serve.request_timeout_s={TIMEOUT_S}", "serve.max_queued_requests=0")
        urls = {name: _url_of(proc) for name, proc in procs.items()}
        for d in ("a", "b"):
            procs["router_" + d] = _start("role=router", f"serve.prefill=[{urls['prefill']}]",
                                          f"serve.decode=[{urls[d]}]")
            urls["router_" + d] = _url_of(procs["router_" + d])
        _URLS.update((k, v) for k, v in urls.items() if not k.startswith("router"))
        yield {"urls": urls, "procs": procs, "release": release}
    finally:
        release.touch()
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            _stop(proc)


def _body(prompt, max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def _post(url: str, body: dict, timeout: float = 120, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout, **kw)


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _served(url: str, **kw) -> None:
    r = _post(url, _body([7, 8, 9, 10, 11]), **kw)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def _all_free(*urls: str) -> None:
    """Every instance's free KV blocks back at its pool size (bounded wait)."""
    for url in urls:
        deadline = time.monotonic() + 60
        while True:
            m = scrape(url)
            free, total = sample(m, "pdflow_kv_blocks_free"), sample(m, "pdflow_kv_blocks_total")
            if free == total or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert free == total > 0, f"{url} holds {total - free} of {total} KV blocks after the request ended"


def _wait_for(what, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"the request never reached the held transfer: {scrape_all()}"
        time.sleep(0.05)


_URLS: dict[str, str] = {}


def scrape_all() -> dict:
    """What a failed wait saw: each live instance's running requests and free blocks."""
    out = {}
    for name, url in _URLS.items():
        try:
            m = scrape(url)
        except httpx.HTTPError as err:
            out[name] = repr(err)
            continue
        out[name] = (sample(m, "pdflow_requests_running"), sample(m, "pdflow_kv_blocks_free"))
    return out


def _holding(url: str) -> bool:
    m = scrape(url)
    return sample(m, "pdflow_kv_blocks_free") < sample(m, "pdflow_kv_blocks_total")


class _InThread:
    """A request sent on a thread, so the test can act while it is in flight."""

    def __init__(self, send):
        self.response: httpx.Response | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True)
        self._thread.start()

    def _run(self, send) -> None:
        try:
            self.response = send()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            self.response = err

    def result(self, timeout: float = 120) -> httpx.Response:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request hung"
        assert isinstance(self.response, httpx.Response), self.response
        return self.response


# -- options -------------------------------------------------------------------------------


def test_separate_instances_report_the_drafters_counts(pd):
    urls = pd["urls"]
    r = _post(urls["router_a"], _body("Question: Omar has 30 shells and loses 4. How many are left?\nAnswer:", 16))
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage.get("num_verify_steps", 0) >= 1, r.text
    assert usage["completion_tokens"] == usage["num_accepted_draft_tokens"] + usage["num_verify_steps"] + 1
    accepted = sample(scrape(urls["a"]), "pdflow_accepted_draft_tokens_total")
    assert accepted >= usage["num_accepted_draft_tokens"]


def test_separate_instances_refuse_a_body_over_max_body_bytes(pd):
    big = _body("x " * 40_000)
    for name in ("a", "prefill"):
        err = _openai_error(_post(pd["urls"][name], big), 413)
        assert "65536" in err["message"], err


def test_a_full_decode_instance_refuses_at_once_and_its_held_requests_time_out(pd):
    """Decode b admits no waiting request (``max_queued_requests=0``): four 6-block prompts
    held mid-transfer fill its 24 blocks, a fifth is a 503 with Retry-After at once; the
    four end at ``request_timeout_s`` with 503 ``request_timeout``, and once the transfer
    is let go every block on both instances is free again."""
    urls, release = pd["urls"], pd["release"]
    release.unlink()
    try:
        held = [_InThread(lambda i=i: _post(urls["router_b"], _body([i + 1, *LONG]))) for i in range(4)]
        _wait_for(lambda: sample(scrape(urls["b"]), "pdflow_requests_running") == 4)  # all admitted
        refused = _post(urls["router_b"], _body([99, *LONG]))
        _openai_error(refused, 503)
        assert refused.headers.get("retry-after"), refused.headers
        for request in held:  # the instance's own 503 (no Retry-After) passes through, its reason with it
            err = _openai_error(request.result(), 503)
            assert err["code"] == "request_timeout" and f"within {TIMEOUT_S:g} s" in err["message"], err
    finally:
        release.touch()
    _all_free(urls["b"], urls["prefill"])
    _served(urls["router_b"])


# -- client abort --------------------------------------------------------------------------


def _aborts(url: str) -> float:
    return sample(scrape(url), "pdflow_requests_total", outcome="abort")


def _dropped(url: str) -> float:
    return sample(scrape(url), "pdflow_remote_prefills_aborted_total")


def test_a_client_gone_mid_stream_or_mid_transfer_frees_both_instances(pd):
    """Mid-stream it may race the last token (then it simply finished); mid-transfer it
    cannot: the transfer is held until the client is gone. The decode instance counts an
    abort and tells the producer, which drops the request (no longer running there) but
    answers only once its export settled: until the transfer is let go, the decode
    instance still holds the blocks it would write (freeing them on the abort would let
    the late write land in reused blocks)."""
    urls, release = pd["urls"], pd["release"]
    with httpx.stream("POST", urls["router_a"] + "/v1/completions", timeout=60,
                      json=_body([9] * 40, 50, stream=True)) as s:
        assert next(s.iter_lines()).startswith("data: ")
    _all_free(urls["a"], urls["prefill"])
    before, dropped = _aborts(urls["a"]), _dropped(urls["prefill"])
    release.unlink()
    try:
        with socket.create_connection(urls["router_a"].removeprefix("http://").split(":")) as raw:
            payload = json.dumps(_body(LONG, stream=True)).encode()
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            _wait_for(lambda: _holding(urls["prefill"]))
        _wait_for(lambda: _aborts(urls["a"]) > before)  # seen while the transfer is still held
        _wait_for(lambda: _dropped(urls["prefill"]) > dropped)
        _wait_for(lambda: sample(scrape(urls["prefill"]), "pdflow_requests_running") == 0)
        for _ in range(20):  # the producer's answer waits for the export: no block comes free
            assert _holding(urls["a"]) and _holding(urls["prefill"]), scrape_all()
            time.sleep(0.05)
    finally:
        release.touch()
    _all_free(urls["a"], urls["prefill"])
    assert _aborts(urls["a"]) == before + 1 and _dropped(urls["prefill"]) == dropped + 1
    _served(urls["router_a"])


def test_a_held_export_holds_up_no_other_request(pd):
    """A consumer that stalls its transfer (held here) holds up neither the producer's own
    API requests nor its prefills for other consumers: its loop never parks on an export
    (it did, until the export settled or ``transfer.timeout_s``)."""
    urls, release = pd["urls"], pd["release"]
    release.unlink()
    try:
        held = _InThread(lambda: _post(urls["router_a"], _body([3, *LONG])))
        _wait_for(lambda: _holding(urls["prefill"]))
        _served(urls["prefill"], timeout=30)  # whole, beside the held export
        assert held.response is None, held.response  # still held
    finally:
        release.touch()
    r = held.result()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    _all_free(urls["a"], urls["prefill"])


def _gone_after_admission(router: str, decode: str, prompt: list[int]) -> None:
    """A streamed request whose client leaves once ``decode`` holds blocks for it."""
    with socket.create_connection(router.removeprefix("http://").split(":")) as raw:
        payload = json.dumps(_body(prompt, stream=True)).encode()
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        _wait_for(lambda: _holding(decode))


def test_a_prefill_queued_at_the_producer_is_dropped_when_its_client_leaves(pd):
    """Four held exports for decode b fill the producer's 24 blocks, so a fifth prompt, via
    decode a, waits in the producer's queue (its ``queue_timeout_s`` is 200 s). Its client
    leaves: decode a tells the producer, which drops it uncomputed and answers at once, so
    decode a's blocks come free while the four are still held (before ``/pdflow/abort``
    they stayed taken until the producer's queue gave up on it)."""
    urls, release = pd["urls"], pd["release"]
    dropped = _dropped(urls["prefill"])
    release.unlink()
    try:
        held = [_InThread(lambda i=i: _post(urls["router_b"], _body([i + 1, *LONG]))) for i in range(4)]
        _wait_for(lambda: sample(scrape(urls["prefill"]), "pdflow_kv_blocks_free") < 6)
        _gone_after_admission(urls["router_a"], urls["a"], [50, *LONG])
        _wait_for(lambda: _dropped(urls["prefill"]) > dropped)
        _all_free(urls["a"])
        assert _holding(urls["prefill"]) and not release.exists()  # the four are still held
    finally:
        release.touch()
    for request in held:  # answered, or ended at b's request_timeout_s meanwhile
        assert request.result().status_code in (200, 503)
    _all_free(urls["a"], urls["b"], urls["prefill"])
    _served(urls["router_a"])


def test_an_abort_before_its_prefill_refuses_the_prefill(pd):
    """The consumer's abort may overtake its own prefill request (two threads): the
    producer keeps it, and the prefill that follows is answered 'ended: abort' at once,
    never run (without it: refused here as an unpaired consumer's)."""
    from pdflow.engine.sampling_params import SamplingParams
    from pdflow.engine.sequence import KVTarget
    from pdflow.serve.pd_wire import AbortPrefill, RemotePrefill

    url, dropped = pd["urls"]["prefill"], _dropped(pd["urls"]["prefill"])
    ask = AbortPrefill(consumer="gone", request_id="r0")
    r = httpx.post(url + "/pdflow/abort", content=msgspec.json.encode(ask), timeout=30)
    assert r.status_code == 200 and r.json() == {"aborted": False}, r.text
    job = RemotePrefill(request_id="r0", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=1),
                        target=KVTarget(blocks=(0,), nonce=1, consumer="gone"))
    r = httpx.post(url + "/pdflow/prefill", content=msgspec.json.encode(job), timeout=30)
    assert r.status_code == 200 and r.json()["error"] == "ended: abort", r.text
    assert _dropped(url) == dropped + 1


# -- schemathesis --------------------------------------------------------------------------


def test_schemathesis_through_router_decode_prefill_finds_no_server_error(pd):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    router = pd["urls"]["router_a"]
    prefills = httpx.get(pd["urls"]["prefill"] + "/pdflow/instance", timeout=10).json()["prefills"]
    schema = schemathesis.openapi.from_url(router + "/openapi.json")
    seen = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=20, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict) and "model" in case.body and len(seen.get("sent", [])) % 2:
                case.body["model"] = MODEL  # every other body names the served model: it reaches the engines
            seen.setdefault("sent", []).append(0)
            response = case.call(base_url=router, timeout=60)
            seen.setdefault(f"{case.method} {case.path}", []).append(response.status_code)
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text[:300]}"
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()
    posts = [seen.get(op, []) for op in ("POST /v1/completions", "POST /v1/chat/completions")]
    assert all(len(codes) >= 10 for codes in posts), seen
    assert any(200 in codes for codes in posts), seen
    assert httpx.get(pd["urls"]["prefill"] + "/pdflow/instance", timeout=10).json()["prefills"] > prefills
    _all_free(pd["urls"]["a"], pd["urls"]["prefill"])
    _served(router)


# -- instances killed (these end instances: last, in this order) --------------------------


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_decode_instance_killed_mid_transfer_is_a_502_and_the_prefill_serves_on(pd):
    urls, release = pd["urls"], pd["release"]
    release.unlink()
    try:
        request = _InThread(lambda: _post(urls["router_b"], _body(LONG)))
        _wait_for(lambda: _holding(urls["prefill"]))
        _kill(pd["procs"]["b"])
    finally:
        release.touch()  # the producer now writes to a consumer that is gone
    _openai_error(request.result(), 502)
    _all_free(urls["prefill"])
    _served(urls["prefill"])  # whole, on its own
    _served(urls["router_a"])  # and P/D with the other decode instance


def test_a_prefill_instance_killed_mid_transfer_is_a_502_and_the_decode_serves_on(pd):
    urls, release = pd["urls"], pd["release"]
    release.unlink()
    request = _InThread(lambda: _post(urls["router_a"], _body(LONG)))
    _wait_for(lambda: _holding(urls["prefill"]))
    _kill(pd["procs"]["prefill"])
    err = _openai_error(request.result(), 502)
    assert "prefill" in err["message"], err
    _all_free(urls["a"])
    _served(urls["a"])  # a request without the router's header is served whole
