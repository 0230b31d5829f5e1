"""The router's choice of instances (``router.policy``), without instances: prompts cut
into chained block hashes, the LRU-bounded prefix index, prefix-first and least-loaded
ordering, and local prefill when every prefill instance is saturated."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdflow import compose
from pdflow.serve.router import create_router
from pdflow.serve.router_policy import Chooser, PrefixIndex, chain_hashes, prompt_blocks
from pdflow.serve.server import ServerThread
from pdflow.spec.errors import ConfigError
from pdflow.spec.router import RouterSpec

D = ["http://d0", "http://d1"]
P = ["http://p0"]


def _body(ids: list[int]) -> bytes:
    return json.dumps({"prompt": ids, "max_tokens": 2}).encode()


def test_token_prompts_cut_into_full_blocks_and_text_by_characters():
    assert len(prompt_blocks(_body(list(range(40))), 16)) == 2  # the partial third block is left out
    text = json.dumps({"messages": [{"role": "user", "content": "x" * 200}]}).encode()
    assert len(prompt_blocks(text, 16)) == (len("user\n") + 200 + 1) // 64
    assert prompt_blocks(b"not json", 16) == [] and prompt_blocks(b"[1, 2]", 16) == []
    a, b = chain_hashes([b"1", b"2"]), chain_hashes([b"9", b"2"])
    assert a[1] != b[1]  # chained: the same block after another prefix is another hash


def test_prefix_index_keeps_at_most_capacity_hashes_least_recent_out():
    index = PrefixIndex(D, capacity=3)
    hashes = chain_hashes([bytes([i]) for i in range(5)])
    index.remember(D[0], hashes[:3])
    assert index.overlap(D[0], hashes) == 3 and index.overlap(D[1], hashes) == 0
    index.remember(D[0], hashes[3:4])  # the oldest (the first block) goes
    assert index.overlap(D[0], hashes) == 0


def _follow_up_goes_to_first_instance(policy: str) -> list[str]:
    """Send four conversations' first turns, then each one's second turn: the decode
    instance each second turn is tried at first, and whether it got that conversation."""
    chooser = Chooser(D, P, RouterSpec(policy=policy), block_tokens=16)
    turns = [[c * 1000 + i for i in range(48)] for c in range(3)]
    where = {}
    for c, ids in enumerate(turns):
        choice = chooser.choose(_body(ids))
        chooser.started(choice, choice.order[0])
        chooser.finished(choice, choice.order[0])
        where[c] = choice.order[0]
    hits = []
    for c, ids in enumerate(turns):
        choice = chooser.choose(_body(ids + list(range(32))))
        hits.append(choice.order[0] == where[c])
        chooser.started(choice, choice.order[0])
        chooser.finished(choice, choice.order[0])
    return hits


def test_prefix_policy_sends_a_follow_up_where_its_prefix_went():
    assert _follow_up_goes_to_first_instance("prefix") == [True, True, True]
    # Round robin over an odd number of conversations alternates them (the test can fail).
    assert _follow_up_goes_to_first_instance("round_robin") != [True, True, True]


def _homes(chooser: Chooser, prompts: list[list[int]]) -> list[str]:
    """Each prompt sent in turn (started and answered before the next): where it went."""
    out = []
    for ids in prompts:
        choice = chooser.choose(_body(ids))
        chooser.started(choice, choice.order[0])
        chooser.finished(choice, choice.order[0])
        out.append(choice.order[0])
    return out


def test_prefix_policy_spreads_conversations_that_share_only_a_system_prompt():
    """Every first turn starts with the same 2-block system prompt (2 of 10 blocks). With
    ``prefix_min_gain`` 0.25 that overlap is a tie and load (then round-robin order)
    spreads the conversations; each one's follow-up (8 of 12 blocks its own) still goes
    where it went. With 0, every conversation piles onto the instance that saw the system
    prompt first (what the rule is for)."""
    system = list(range(5000, 5032))
    firsts = [system + [c * 1000 + i for i in range(128)] for c in range(6)]
    follow_ups = [ids + list(range(32)) for ids in firsts]
    spread = Chooser(D, P, RouterSpec(policy="prefix"), block_tokens=16)
    homes = _homes(spread, firsts)
    assert sorted(homes) == sorted(D * 3)
    assert _homes(spread, follow_ups) == homes
    piled = Chooser(D, P, RouterSpec(policy="prefix", prefix_min_gain=0.0), block_tokens=16)
    assert len(set(_homes(piled, firsts))) == 1


def test_prefix_policy_passes_over_an_instance_with_too_many_more_in_flight():
    """A follow-up's prefix is on one instance; with ``prefix_max_skew`` 2 and two more
    requests in flight there than on the other, it goes to the other; at 3, it stays."""
    prompt = [7] * 64
    for skew, stays in ((2, False), (3, True)):
        chooser = Chooser(D, P, RouterSpec(policy="prefix", prefix_max_skew=skew), block_tokens=16)
        (home,) = _homes(chooser, [prompt])
        for i in range(2):  # two others in flight at the conversation's instance
            other = chooser.choose(_body([100 + i] * 20))
            chooser.started(other, home)
        assert (chooser.choose(_body(prompt + [8] * 16)).order[0] == home) is stays


def test_load_policy_tries_the_least_loaded_first_and_prefills_locally_when_saturated():
    chooser = Chooser(D, P, RouterSpec(policy="load", max_prefills_in_flight=1), block_tokens=16)
    first = chooser.choose(_body([1] * 20))
    assert first.producer == P[0]
    chooser.started(first, first.order[0])
    busy = first.order[0]
    second = chooser.choose(_body([2] * 20))
    assert second.order[0] != busy  # the other one has nothing in flight
    assert second.producer is None and chooser.local_prefills == 1  # p0 holds its one prefill
    chooser.finished(first, busy)
    assert chooser.choose(_body([3] * 20)).producer == P[0]


def test_a_producer_counts_a_request_from_its_send_to_the_decode_instances_answer():
    """A prefill instance's load is the prefills sent to it and not yet answered: once the
    decode instance answers (a stream's first token), the producer is free again while the
    stream goes on, and a second release (the stream's end) takes nothing more."""
    chooser = Chooser(D, P, RouterSpec(policy="load", max_prefills_in_flight=1), block_tokens=16)
    first = chooser.choose(_body([1] * 20))
    chooser.started(first, first.order[0])
    assert chooser.in_flight == {first.order[0]: 1, first.order[1]: 0, P[0]: 1}
    assert chooser.choose(_body([2] * 20)).producer is None  # saturated while it prefills
    chooser.prefilled(first)
    assert chooser.in_flight[P[0]] == 0 and chooser.in_flight[first.order[0]] == 1
    assert chooser.choose(_body([3] * 20)).producer == P[0]  # decoding on: no load on p0
    chooser.finished(first, first.order[0])
    assert set(chooser.in_flight.values()) == {0}


def test_a_bad_router_policy_is_refused_by_name():
    with pytest.raises(ConfigError, match="router.policy"):
        compose(["router.policy=nearest"])
    with pytest.raises(ConfigError, match="local_prefill_tokens"):
        compose(["router.local_prefill_tokens=-1"])
    with pytest.raises(ConfigError, match="local_prefill_factor must be above 1"):
        compose(["router.local_prefill_factor=1.0"])
    with pytest.raises(ConfigError, match="prefix_min_gain must be in"):
        compose(["router.prefix_min_gain=1.0"])
    with pytest.raises(ConfigError, match="prefix_max_skew >= 0"):
        compose(["router.prefix_max_skew=-1"])


def test_load_policy_breaks_an_in_flight_tie_by_free_kv_blocks():
    chooser = Chooser(D, P, RouterSpec(policy="load"), block_tokens=16)
    chooser.set_free(D[0], 0.1)
    chooser.set_free(D[1], 0.9)
    assert [chooser.choose(_body([k] * 20)).order[0] for k in range(4)] == [D[1]] * 4
    chooser.set_free(D[1], 0.05)
    assert chooser.choose(_body([9] * 20)).order[0] == D[0]


def _named_backend(name: str) -> FastAPI:
    """Answers every completion with its name, streamed when asked."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        if not body.get("stream"):
            return {"backend": name}

        async def chunks():
            yield f'data: {{"backend": "{name}"}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_the_router_releases_each_request_it_counted_streamed_or_not():
    """policy=load through real HTTP: a streamed answer's request leaves the in-flight count
    once its stream ends, so later requests keep the round-robin order on the tie; a leaked
    count would send all of them to the other backend."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(_named_backend(n))).url for n in ("a", "b")]
        router = stack.enter_context(ServerThread(create_router(urls, router=RouterSpec(policy="load"))))
        got = []
        for i in range(4):
            body = {"model": "m", "prompt": [i] * 20, "max_tokens": 1, "stream": i == 0}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            got.append(r.text.split('"backend": "')[1][0] if i == 0 else r.json()["backend"])
    assert got == ["a", "b", "a", "b"]


def test_the_router_counts_a_request_as_load_before_its_backend_answers():
    """policy=load through real HTTP: a request whose backend has not answered yet (a
    prefill under way: a stream's headers come with its first token) is load there, so the
    next request goes to the idle backend. Counted only from the answer, the held backend
    looked idle and round robin's turn sent the third request to it."""
    import asyncio
    import threading

    release, held = threading.Event(), threading.Event()

    def backend(name: str) -> FastAPI:
        app = _named_backend(name)
        if name == "a":
            @app.middleware("http")
            async def hold(request, call_next):  # a completion sent to "a" waits for the test
                if request.url.path == "/v1/completions":  # (not the router's /metrics polls)
                    held.set()
                    await asyncio.to_thread(release.wait, 30)
                return await call_next(request)
        return app

    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(backend(n))).url for n in ("a", "b")]
        router = stack.enter_context(ServerThread(create_router(urls, router=RouterSpec(policy="load"))))

        def post(i: int, out: list) -> None:
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": [i] * 20,
                                                                 "max_tokens": 1}, timeout=10)
            out.append(r.json()["backend"])

        first: list[str] = []
        sender = threading.Thread(target=post, args=(0, first))
        sender.start()
        try:
            assert held.wait(10)
            later: list[str] = []
            post(1, later)  # round robin's order is b, a here anyway
            post(2, later)  # its order is a, b: a holds one request, b none
        finally:
            release.set()
            sender.join(30)
    assert first == ["a"] and later == ["b", "b"]


def test_the_free_block_poll_reads_an_instances_gauges_as_the_exposition_parser_does():
    """The router reads two gauges off each instance's /metrics twice a second: by their
    lines, not by parsing every sample (a tenth of the router's CPU); the same fraction."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from pdflow.serve.metrics import ServeMetrics
    from pdflow.serve.router_policy import free_fraction

    backend = SimpleNamespace(num_kv_blocks=1169, num_free_kv_blocks=301, startup_s=1.0, compile_s=0.5)
    text = ServeMetrics(backend).render().decode()
    parsed = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert free_fraction(text) == parsed["pdflow_kv_blocks_free"] / parsed["pdflow_kv_blocks_total"] == 301 / 1169
    assert free_fraction("pdflow_kv_blocks_total 8.0 1700000000\npdflow_kv_blocks_free_x 1\n") == 0.0
    assert free_fraction("# no gauges\nother 1\n") is None
    assert free_fraction("pdflow_kv_blocks_total 0\npdflow_kv_blocks_free 0\n") is None
