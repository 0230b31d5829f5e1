"""The engine loop and the API around it, over a scripted backend (no model): order of
delivery, aborts, concurrency, and what a client sees when the engine dies."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.api import EngineHost, create_app
from pdflow.serve.backend import DraftStats
from pdflow.serve.engine_loop import EngineLoop
from pdflow.serve.server import ServerThread


class ScriptedBackend:
    """Each request emits tokens 10, 11, ... (text "a", "b", ...) one per step for every
    running request; ``fail_after`` steps, ``step`` raises (a dead engine)."""

    max_model_len, vocab_size, tokenizer = 64, 100, None
    num_kv_blocks, block_size = 8, 16
    startup_s = compile_s = 0.0  # a script compiles nothing

    def __init__(self, *, fail_after: int | None = None, draft: bool = False, step_s: float = 0.0):
        self.step_s = step_s
        self.running: dict[str, list] = {}
        self.ids = 0
        self.steps = 0
        self.fail_after, self.draft = fail_after, draft
        self.aborted: list[str] = []
        self.max_running = 0
        self.routes: list = []  # each added request's route (P/D), in order

    @property
    def num_free_kv_blocks(self) -> int:
        return self.num_kv_blocks - len(self.running)

    def add(self, prompt_token_ids, sampling, *, route=None):
        if len(prompt_token_ids) > 50:
            raise ValueError("prompt too long for the script")
        self.routes.append(route)
        self.ids += 1
        self.running[str(self.ids)] = [0, sampling.max_tokens]
        self.max_running = max(self.max_running, len(self.running))
        return str(self.ids)

    def abort(self, request_id):
        self.aborted.append(request_id)
        return self.running.pop(request_id, None) is not None

    def step(self):
        if not self.running:  # idle, as LLM.step: the loop steps an idle backend (cheap, nothing run)
            return []
        time.sleep(self.step_s)
        self.steps += 1
        if self.fail_after is not None and self.steps > self.fail_after:
            raise RuntimeError("device lost")
        out = []
        for rid, state in list(self.running.items()):
            i, limit = state
            state[0] += 1
            done = i + 1 == limit
            out.append(TokenOutput(request_id=rid, index=i, token_id=10 + i, logprob=0.0, text="abcdefgh"[i % 8],
                                   finished=done, finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return out

    def wake(self):
        pass

    def draft_stats(self, request_id):
        return DraftStats(drafted=8, accepted=6, verify_steps=2) if self.draft else None

    def shutdown(self):
        pass


async def _collect(loop: EngineLoop, ids, max_tokens):
    ticket, events = loop.open_stream(ids, SamplingParams(max_tokens=max_tokens))
    got = []
    while True:
        event = await events.get()
        got.append(event)
        if event.done:
            return ticket, got


def test_loop_delivers_each_requests_tokens_in_order_and_concurrently():
    backend = ScriptedBackend()
    loop = EngineLoop(backend).start()

    async def main():
        return await asyncio.gather(*(_collect(loop, [1, 2], n) for n in (3, 5, 1)))

    try:
        results = asyncio.run(main())
    finally:
        loop.stop()
    for (_, events), n in zip(results, (3, 5, 1), strict=True):
        assert [e.token_ids[0] for e in events] == list(range(10, 10 + n))
        assert events[-1].finish_reason == "length" and not any(e.done for e in events[:-1])
    assert backend.max_running >= 2  # requests shared steps


def test_refused_prompt_is_an_error_event_not_a_dead_loop():
    backend = ScriptedBackend()
    loop = EngineLoop(backend).start()
    try:
        _, events = asyncio.run(_collect(loop, list(range(60)), 2))
        assert events[-1].error == "prompt too long for the script" and events[-1].error_status == 400
        _, events = asyncio.run(_collect(loop, [1], 2))
        assert events[-1].finish_reason == "length"
    finally:
        loop.stop()


def test_abort_before_admission_never_reaches_the_backend():
    backend = ScriptedBackend()
    loop = EngineLoop(backend)  # not started: the submit waits in the inbox
    done = threading.Event()
    ticket = None

    async def main():
        nonlocal ticket
        ticket, _ = loop.open_stream([1], SamplingParams(max_tokens=4))
        loop.abort(ticket)
        loop.start()
        await asyncio.sleep(0.3)
        done.set()

    asyncio.run(main())
    loop.stop()
    assert ticket.request_id is None and backend.ids == 0 and done.is_set()


class AwaitingBackend(ScriptedBackend):
    """A request with a route waits for work elsewhere (a remote prefill's answer): while
    only such requests are in, ``step`` waits for it, as ``DecodeBackend`` does, here for
    ``WAIT_S`` unless woken (a real one waits a few ms)."""

    WAIT_S = 120.0

    def __init__(self):
        super().__init__()
        self.parked: set[str] = set()
        self.woken, self.waiting, self.release = threading.Event(), threading.Event(), threading.Event()

    def add(self, prompt_token_ids, sampling, *, route=None):
        rid = super().add(prompt_token_ids, sampling, route=route)
        if route is not None:
            self.parked.add(rid)
        return rid

    def wake(self):
        self.woken.set()

    def step(self):
        if self.release.is_set():
            self.parked.clear()
        if self.running and set(self.running) <= self.parked:
            self.waiting.set()
            self.woken.wait(self.WAIT_S)
            self.woken.clear()
            return []
        parked = {rid: self.running.pop(rid) for rid in self.parked if rid in self.running}
        try:
            return super().step()
        finally:
            self.running.update(parked)


def test_a_request_that_comes_while_the_backend_waits_on_other_work_is_admitted_at_once():
    """The loop steps a backend that may wait inside ``step`` for work it expects (a decode
    instance for a producer's answer): a request submitted meanwhile wakes it, rather than
    waiting out the wait behind a request parked elsewhere (issue 33: a locally prefilled
    turn held back by another's exchange)."""
    from pdflow.serve.pd_wire import PDRoute

    backend = AwaitingBackend()
    loop = EngineLoop(backend).start()

    async def main():
        parked = asyncio.ensure_future(_collect_routed(loop, PDRoute(prefill_at="http://127.0.0.1:9")))
        while not backend.waiting.is_set():  # the loop is inside step, waiting for the parked one
            await asyncio.sleep(0.01)
        _, events = await asyncio.wait_for(_collect(loop, [1, 2], 2), timeout=60)
        backend.release.set()
        backend.wake()
        return events, await asyncio.wait_for(parked, timeout=60)

    try:
        events, parked = asyncio.run(main())
    finally:
        backend.release.set()
        backend.wake()
        loop.stop()
    assert [e.token_ids[0] for e in events] == [10, 11] and events[-1].finish_reason == "length"
    assert parked[-1].finish_reason == "length"


async def _collect_routed(loop: EngineLoop, route):
    _, events = loop.open_stream([1], SamplingParams(max_tokens=1), route=route)
    got = [await events.get()]
    while not got[-1].done:
        got.append(await events.get())
    return got


@pytest.fixture
def scripted_server():
    def start(backend, route_of=None):
        host = EngineHost(backend, route_of=route_of).start()
        server = ServerThread(create_app(host, model_name="script")).start()
        started.append((host, server))
        return server.url

    started = []
    yield start
    for host, server in started:
        server.stop()
        host.stop()


def test_dead_engine_fails_requests_with_500_and_health_turns_503(scripted_server):
    url = scripted_server(ScriptedBackend(fail_after=2))
    r = httpx.post(url + "/v1/completions", json={"model": "script", "prompt": [1, 2], "max_tokens": 10})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error" and "device lost" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 503
    r = httpx.post(url + "/v1/completions", json={"model": "script", "prompt": [1], "max_tokens": 1})
    assert r.status_code == 503


def test_draft_counts_reach_usage_and_metrics(scripted_server):
    url = scripted_server(ScriptedBackend(draft=True))
    r = httpx.post(url + "/v1/completions", json={"model": "script", "prompt": [1], "max_tokens": 3})
    usage = r.json()["usage"]
    assert (usage["num_draft_tokens"], usage["num_accepted_draft_tokens"], usage["num_verify_steps"]) == (8, 6, 2)
    text = httpx.get(url + "/metrics").text
    assert "pdflow_draft_acceptance_rate 0.75" in text
    plain = scripted_server(ScriptedBackend())
    usage = httpx.post(plain + "/v1/completions", json={"model": "script", "prompt": [1], "max_tokens": 3}).json()
    assert "num_draft_tokens" not in usage["usage"]


def test_prompt_text_needs_a_tokenizer(scripted_server):
    url = scripted_server(ScriptedBackend())
    r = httpx.post(url + "/v1/completions", json={"model": "script", "prompt": "words", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/chat/completions",
                   json={"model": "script", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_client_that_gives_up_on_a_non_streamed_answer_aborts_it(scripted_server):
    backend = ScriptedBackend(step_s=0.05)
    url = scripted_server(backend)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": "script", "prompt": [1], "max_tokens": 60}, timeout=0.5)
    deadline = time.monotonic() + 10
    while not backend.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.aborted == ["1"] and not backend.running
    assert 'pdflow_requests_total{outcome="abort"} 1.0' in httpx.get(url + "/metrics").text


def test_a_decode_hosts_route_of_reads_the_routers_header_onto_each_choices_ticket(scripted_server):
    from pdflow.serve.pd_decode import prefill_route
    from pdflow.serve.pd_wire import PREFILL_HEADER, PDRoute

    backend = ScriptedBackend()
    url = scripted_server(backend, route_of=prefill_route)
    body = {"model": "script", "prompt": [1], "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    r = httpx.post(url + "/v1/completions", json=body | {"n": 2}, headers={PREFILL_HEADER: "http://127.0.0.1:9/"})
    assert r.status_code == 200
    assert backend.routes == [None, PDRoute(prefill_at="http://127.0.0.1:9"), PDRoute(prefill_at="http://127.0.0.1:9")]
    plain = ScriptedBackend()  # a host without route_of ignores the header
    r = httpx.post(scripted_server(plain) + "/v1/completions", json=body, headers={PREFILL_HEADER: "http://x"})
    assert r.status_code == 200 and plain.routes == [None]


def test_a_refused_route_is_a_400_about_no_body_field_and_a_refused_prompt_names_prompt(scripted_server):
    """A route comes from the router's header, not the body: its refusal's error names no
    ``param`` (it once said "prompt"); a prompt the backend refuses still does."""
    from pdflow.serve.pd_decode import prefill_route
    from pdflow.serve.pd_wire import PREFILL_HEADER, RouteRefused

    class NoRoutes(ScriptedBackend):
        def add(self, prompt_token_ids, sampling, *, route=None):
            if route is not None:
                raise RouteRefused("this backend serves every request whole")
            return super().add(prompt_token_ids, sampling, route=route)

    url = scripted_server(NoRoutes(), route_of=prefill_route)
    body = {"model": "script", "prompt": [1], "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=body, headers={PREFILL_HEADER: "http://127.0.0.1:9/"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None and "whole" in error["message"]
    r = httpx.post(url + "/v1/completions", json=body | {"prompt": list(range(60))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
