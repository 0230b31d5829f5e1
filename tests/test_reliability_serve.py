"""Reliability of the served P/D path, through the router over HTTP (loopback): bad
input (a hand-written table and schemathesis against the router's OpenAPI schema), a
client that disconnects, a failed KV transfer, a request timeout, and load. One P/D
deployment (tp1 -> tp1, both in this process, real Mooncake over TCP) serves every test
here; after each, both instances' free KV blocks must be back at their pool size.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass

import httpx
import pytest
from bench_load import run_load, sample, scrape, tiny_prompts

from pdflow import Deployment, compose
from pdflow.serve.api import EngineHost, create_app
from pdflow.serve.backend import LLMBackend
from pdflow.serve.router import create_router
from pdflow.serve.server import ServerThread
from pdflow.worker.faults import ENV as FAULT_ENV
from pdflow.worker.faults import RELEASE_ENV

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

MODEL = "tiny-pd"
MAX_MODEL_LEN = 96
BODY_LIMIT = 64 << 10
REQUEST_TIMEOUT_S = 0.25
OVERRIDES = ["prefill=tp1", "decode=tp1", "drafter=none", f"model.max_model_len={MAX_MODEL_LEN}",
             "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16",
             "decode.kv_page_tokens=16", "prefill.num_kv_blocks=48", "decode.num_kv_blocks=48",
             "transfer.timeout_s=10"]
# The load test's size: 1000 at concurrency 64 takes minutes on this CPU deployment
# (scripts/bench_load.py runs those); this many still keeps 64 in flight for two waves.
LOAD_REQUESTS, LOAD_CONCURRENCY = 1000, 64


@dataclass
class Stack:
    deployment: Deployment
    host: EngineHost
    instance: str  # the instance API
    router: str  # the router over it
    timed_router: str  # a router over the same engine's API with a request timeout

    def pools(self) -> dict[str, tuple[int, int]]:
        d = self.deployment
        return {role: (e.num_free_kv_blocks, e.num_kv_blocks)
                for role, e in (("prefill", d.producer), ("decode", d.consumer))}

    def wait_idle(self, timeout: float = 30.0) -> dict[str, tuple[int, int]]:
        """The pools once nothing runs (or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pools = self.pools()
            if self.host.loop.num_active == 0 and all(free == total for free, total in pools.values()):
                break
            time.sleep(0.05)
        return self.pools()

    def assert_no_leak(self) -> None:
        pools = self.wait_idle()
        assert all(free == total for free, total in pools.values()), f"blocks leaked: {pools}"


@pytest.fixture(scope="module")
def stack():
    deployment = Deployment(compose(OVERRIDES))
    with contextlib.ExitStack() as stop:
        stop.callback(deployment.shutdown)
        backend = LLMBackend(deployment)
        host = EngineHost(backend).start()
        stop.callback(host.stop)
        instance = stop.enter_context(ServerThread(create_app(host, model_name=MODEL, max_body_bytes=BODY_LIMIT)))
        timed = stop.enter_context(ServerThread(create_app(host, model_name=MODEL,
                                                           request_timeout_s=REQUEST_TIMEOUT_S)))
        router = stop.enter_context(ServerThread(create_router([instance.url], max_body_bytes=BODY_LIMIT)))
        timed_router = stop.enter_context(ServerThread(create_router([timed.url])))
        yield Stack(deployment=deployment, host=host, instance=instance.url, router=router.url,
                    timed_router=timed_router.url)


def _complete(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True} | fields
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def _served_after(stack: Stack) -> None:
    """The deployment still serves, whole, and holds no block it should not."""
    r = _complete(stack.router)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert stack.deployment.lost == {"prefill": None, "decode": None}
    stack.assert_no_leak()


# -- bad input ------------------------------------------------------------------------------

LONG = "x " * (MAX_MODEL_LEN + 8)
BAD_BODIES = [
    # (case, raw body or JSON fields, status, code)
    ("prompt past max_model_len", {"prompt": LONG}, 400, "context_length_exceeded"),
    ("token prompt past max_model_len", {"prompt": [5] * MAX_MODEL_LEN}, 400, "context_length_exceeded"),
    ("max_tokens 0", {"max_tokens": 0}, 400, "invalid_value"),
    ("max_tokens negative", {"max_tokens": -3}, 400, "invalid_value"),
    ("max_tokens huge", {"max_tokens": 10**30}, 400, "context_length_exceeded"),
    ("max_tokens float", {"max_tokens": 2.5}, 400, "invalid_type"),
    ("unknown model", {"model": "gpt-9"}, 404, "model_not_found"),
    ("stop not a string", {"stop": 3}, 400, "invalid_value"),
    ("empty stop", {"stop": [""]}, 400, "invalid_value"),
    ("stop of objects", {"stop": [{"a": 1}]}, 400, "invalid_value"),
    ("lone surrogate in the prompt", b'{"model": "tiny-pd", "prompt": "a\\ud800b", "max_tokens": 1}', None, None),
    ("non-UTF-8 body", b'{"model": "tiny-pd", "prompt": "\xff\xfe\xfd", "max_tokens": 1}', 400, "invalid_json"),
    ("binary body", bytes(range(256)), 400, "invalid_json"),
    ("empty body", b"", 400, "invalid_json"),
    ("JSON null", b"null", 400, None),
    ("JSON list", b"[1, 2]", 400, None),
    ("deep nesting", b"[" * 5000 + b"]" * 5000, 400, None),
]


@pytest.mark.parametrize(("case", "body", "status", "code"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_through_the_router_is_a_4xx_with_an_openai_body(stack, case, body, status, code):
    if isinstance(body, dict):
        r = _complete(stack.router, **body)
    else:
        r = httpx.post(stack.router + "/v1/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
    if status is None:  # either answer is fine, as long as it is not a server error
        assert r.status_code < 500, r.text
        assert r.status_code == 200 or "error" in r.json()
    else:
        _assert_openai_error(r, status, code)


def test_oversized_bodies_get_413_declared_or_chunked(stack):
    big = b'{"model": "tiny-pd", "prompt": "' + b"a" * BODY_LIMIT + b'"}'
    for url in (stack.router, stack.instance):
        r = httpx.post(url + "/v1/completions", content=big, headers={"content-type": "application/json"})
        _assert_openai_error(r, 413, "request_too_large")

        def chunks():  # no Content-Length: the cap must hold while the body streams in
            for i in range(0, len(big), 4096):
                yield big[i:i + 4096]

        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        _assert_openai_error(r, 413, "request_too_large")
    _served_after(stack)


def test_schemathesis_finds_no_server_error(stack):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(stack.router + "/openapi.json")
    seen = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=30, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=stack.router, timeout=60)
            seen.setdefault(f"{case.method} {case.path}", []).append(response.status_code)
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text[:300]}"
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()
    print("\nschemathesis answers:", {op: sorted(set(codes)) for op, codes in seen.items()})
    posts = [seen.get(op, []) for op in ("POST /v1/completions", "POST /v1/chat/completions")]
    assert all(len(codes) >= 10 for codes in posts), seen  # it did generate bodies
    assert httpx.get(stack.router + "/health").status_code == 200
    _served_after(stack)


# -- disconnects -----------------------------------------------------------------------------


def _wait_aborted(stack: Stack, before: dict, count: int) -> dict:
    """The instance's metrics once ``count`` aborts were counted since ``before`` and the
    engine is idle (or after 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        now = scrape(stack.instance)
        aborted = sample(now, "pdflow_requests_total", outcome="abort") - sample(
            before, "pdflow_requests_total", outcome="abort")
        if (aborted >= count and stack.host.loop.num_active == 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_a_client_gone_mid_stream_is_aborted_on_both_instances(stack):
    before = scrape(stack.instance)
    body = {"model": MODEL, "prompt": [9] * 40, "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.router + "/v1/completions", json=body, timeout=60) as s:
        assert next(s.iter_lines()).startswith("data: ")
    _wait_aborted(stack, before, 1)
    # And one that leaves as soon as the engine took it, straight at the instance: it may
    # still be queued, prefilling on the producer, or on its way to the consumer.
    with socket.create_connection(stack.instance.removeprefix("http://").split(":")) as raw:
        payload = (b'{"model": "tiny-pd", "prompt": [' + b"11," * 30 + b'11], "max_tokens": 50, "stream": true,'
                   b' "ignore_eos": true}')
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 30
        while stack.host.loop.num_active == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert stack.host.loop.num_active == 1, "the engine never took the request"
    after = _wait_aborted(stack, before, 2)
    stack.assert_no_leak()
    aborted = sample(after, "pdflow_requests_total", outcome="abort") - sample(
        before, "pdflow_requests_total", outcome="abort")
    generated = sample(after, "pdflow_generation_tokens_total") - sample(before, "pdflow_generation_tokens_total")
    assert aborted == 2
    assert generated < 50, "a disconnected request ran on to its end"
    _served_after(stack)


# -- faults ----------------------------------------------------------------------------------


def test_a_failed_transfer_is_a_502_and_the_deployment_serves_on(stack, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "export:prefill:0:error")  # the in-process producer rank reads it
    r = _complete(stack.router)
    monkeypatch.delenv(FAULT_ENV)
    err = _assert_openai_error(r, 502, "backend_error")
    assert "KV transfer failed" in err["message"] and "injected export fault" in err["message"]
    stream = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "stream": True}
    monkeypatch.setenv(FAULT_ENV, "export:prefill:0:error")
    r = httpx.post(stack.router + "/v1/completions", json=stream, timeout=60)
    monkeypatch.delenv(FAULT_ENV)
    _assert_openai_error(r, 502, "backend_error")  # the first event is the error: no 200 was sent
    assert 'outcome="error"' in httpx.get(stack.instance + "/metrics").text
    _served_after(stack)


def test_a_request_past_its_timeout_is_aborted_and_answered_in_time(stack, monkeypatch, tmp_path):
    # Its prompt's KV transfer is held until released, so it cannot finish in time however
    # fast the engine runs (88 tokens alone took under the timeout on an idle machine).
    release = tmp_path / "release"
    monkeypatch.setenv(FAULT_ENV, "export:prefill:0:hold")
    monkeypatch.setenv(RELEASE_ENV, str(release))
    start = time.monotonic()
    try:
        r = _complete(stack.timed_router, max_tokens=MAX_MODEL_LEN - 8)
        took = time.monotonic() - start
    finally:
        release.touch()
        monkeypatch.delenv(FAULT_ENV)
    # the instance's own 503 passes through the router, its reason and code with it
    err = _assert_openai_error(r, 503, "request_timeout")
    assert f"within {REQUEST_TIMEOUT_S:g} s" in err["message"] and "retry-after" not in r.headers
    assert took < REQUEST_TIMEOUT_S + 5.0, f"answered after {took:.1f} s"
    stack.assert_no_leak()  # the held export settled after the release: its blocks came back
    _served_after(stack)


# -- load ------------------------------------------------------------------------------------


def test_load_through_the_router_completes_everything_and_counts_agree(stack):
    before, routed_before = scrape(stack.instance), scrape(stack.router)
    prompts = tiny_prompts(LOAD_REQUESTS, vocab=stack.deployment.vocab_size, seed=3)
    report = run_load(stack.router, MODEL, prompts, max_tokens=4, concurrency=LOAD_CONCURRENCY)
    print(f"\nload through the router ({LOAD_REQUESTS} at concurrency {LOAD_CONCURRENCY}): {report.line()}")
    assert report.completed == LOAD_REQUESTS, report.errors
    stack.assert_no_leak()
    after, routed = scrape(stack.instance), scrape(stack.router)

    def delta(new, old, name, **labels):
        return sample(new, name, **labels) - sample(old, name, **labels)

    assert delta(after, before, "pdflow_requests_total", outcome="length") == LOAD_REQUESTS
    assert delta(after, before, "pdflow_generation_tokens_total") == report.completion_tokens == 4 * LOAD_REQUESTS
    assert delta(after, before, "pdflow_time_to_first_token_seconds_count") == LOAD_REQUESTS
    assert delta(routed, routed_before, "pdflow_router_requests_total", backend=stack.instance,
                 outcome="ok") == LOAD_REQUESTS
    for outcome in ("error", "abort", "rejected"):
        assert delta(after, before, "pdflow_requests_total", outcome=outcome) == 0


# -- admission -------------------------------------------------------------------------------


def test_a_full_kv_pool_queues_a_bounded_few_and_refuses_the_rest_with_retry_after():
    """Eight blocks of 16 tokens; each request's prompt needs three, so two run at once,
    two may wait (max_queued) for half a second, and the rest are refused at once."""
    from concurrent.futures import ThreadPoolExecutor

    from pdflow import LLM
    from pdflow.serve.admission import AdmissionPolicy
    from pdflow.spec import ParallelSpec

    parallel = ParallelSpec(block_size=16, kv_page_tokens=16, num_kv_blocks=8, max_num_seqs=8)
    llm = LLM("pdflow:assets/tiny", parallel, max_model_len=128)
    with contextlib.ExitStack() as stop:
        stop.callback(llm.shutdown)
        host = EngineHost(LLMBackend(llm),
                          admission=AdmissionPolicy(max_queued=2, queue_timeout_s=0.5, retry_after_s=2)).start()
        stop.callback(host.stop)
        instance = stop.enter_context(ServerThread(create_app(host, model_name="tiny")))
        router = stop.enter_context(ServerThread(create_router([instance.url])))
        body = {"model": "tiny", "prompt": list(range(4, 44)), "max_tokens": 80, "ignore_eos": True}
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda _: httpx.post(router.url + "/v1/completions", json=body, timeout=120),
                                    range(12)))
        served = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 503]
        assert len(served) + len(refused) == len(answers), [r.text for r in answers]
        assert all(r.headers["retry-after"] == "2" for r in refused)
        assert all(r.json()["error"]["code"] == "server_overloaded" for r in refused)
        assert 2 <= len(served) <= 2 + 2, "more requests were served than could be held or queued"
        assert any("capacity" in r.json()["error"]["message"] for r in refused)  # refused at once
        assert host.loop.admission.num_waiting == 0 and host.loop.admission.reserved == 0
        deadline = time.monotonic() + 10
        while llm.num_free_kv_blocks != llm.num_kv_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.num_free_kv_blocks == llm.num_kv_blocks
        counted = scrape(instance.url)
        assert sample(counted, "pdflow_requests_total", outcome="rejected") == len(refused)
        assert sample(counted, "pdflow_requests_total", outcome="error") == 0
        again = httpx.post(router.url + "/v1/completions", json=body | {"max_tokens": 2}, timeout=60)
        assert again.status_code == 200, again.text
