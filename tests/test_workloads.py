"""Workloads: the requests they build, how they score, the latency figures, and the HTTP
driver's timing and concurrency against a real (scripted) streaming server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdflow.bench.tasks import arith_eval_set
from pdflow.bench.workloads import RequestResult, Target, WorkloadFailed, build_workloads, drive, prepare
from pdflow.bench.workloads.base import WorkRequest
from pdflow.bench.workloads.client import drive_turns
from pdflow.bench.workloads.load import TraceError
from pdflow.bench.workloads.multiturn import hit_rate_bounds, turn_lengths
from pdflow.bench.workloads.runner import run_workloads
from pdflow.bench.workloads.stats import draft_metrics, latency_metrics, percentile
from pdflow.serve.server import ServerThread
from pdflow.spec import WorkloadSpec


def spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(**kw)


def ok(text="", **kw) -> RequestResult:
    return RequestResult(ok=True, text=text, **kw)


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.05]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], q))


def test_arith_scores_gold_solutions_right_and_wrong_answers_wrong():
    (w,) = build_workloads(spec(kind="arith", num_requests=4, k_shot=1, context_len=1024, max_tokens=320),
                           vocab=128)
    reqs = w.requests()
    items = arith_eval_set(4, k_shot=1, seed=0, max_context=1024)
    assert [r.prompt for r in reqs] == [it.prompt for it in items]
    assert all(r.stop == ["\n\n", "Question:"] and r.temperature == 0 for r in reqs)
    gold = [f" ...\n#### {r.meta['answer']}" for r in reqs]
    outputs = [ok(gold[0]), ok(gold[1]), ok(f" #### {reqs[2].meta['answer'] + 1}"),
               RequestResult(ok=False, error="HTTP 500")]
    metrics, parts = w.score(reqs, outputs)
    assert metrics["arith_strict"] == 0.5 and metrics["arith_flexible"] == 0.5
    assert set(parts["arith strict accuracy by steps"]) <= {"steps_2", "steps_3", "steps_4"}


def test_needle_scores_by_depth():
    (w,) = build_workloads(spec(kind="needle", num_requests=2, context_len=256, depths=[0.0, 1.0]), vocab=128)
    reqs = w.requests()
    assert [r.meta["depth"] for r in reqs] == [0.0, 0.0, 1.0, 1.0]
    assert all(len(r.prompt) <= 256 - 1 for r in reqs)
    outs = [ok(" " + r.meta["answer"] + "\n") for r in reqs[:3]] + [ok(" 0000")]
    metrics, _ = w.score(reqs, outs)
    assert metrics["needle_accuracy"] == 0.75
    assert (metrics["needle_accuracy_depth_0.00"], metrics["needle_accuracy_depth_1.00"]) == (1.0, 0.5)


def test_accuracy_is_arith_then_needle_and_none_is_nothing():
    names = [w.name for w in build_workloads(spec(kind="accuracy", num_requests=1, k_shot=0), vocab=128)]
    assert names == ["arith", "needle"]
    assert build_workloads(spec(kind="none"), vocab=128) == []


def test_prefill_prompts_are_exact_length_distinct_and_one_token():
    (w,) = build_workloads(spec(kind="prefill", num_requests=5, prompt_tokens=33), vocab=128)
    reqs = w.requests()
    assert all(len(r.prompt) == 33 and r.max_tokens == 1 and r.ignore_eos for r in reqs)
    assert all(4 <= t < 128 for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 5  # no shared prefix block


def test_serve_lengths_in_range_and_poisson_arrivals_increase():
    (w,) = build_workloads(spec(kind="serve", num_requests=50, input_len=[3, 9], output_len=[2, 4],
                                request_rate=5.0), vocab=128)
    reqs = w.requests()
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 4 for r in reqs)
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals[0] == 0 and all(b > a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert 50 / 5.0 * 0.5 < arrivals[-1] < 50 / 5.0 * 2  # mean gap 1/rate


def test_replay_sorts_scales_and_names_bad_lines(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 3.0, "prompt": "b", "max_tokens": 2}\n\n'
                     '{"arrival_s": 1.0, "prompt_tokens": 7}\n')
    (w,) = build_workloads(spec(kind="replay", trace="t.jsonl", time_scale=0.5, max_tokens=9), vocab=128,
                           base_dir=tmp_path)
    reqs = w.requests()
    assert [r.arrival_s for r in reqs] == [0.0, 1.0]
    assert len(reqs[0].prompt) == 7 and reqs[0].max_tokens == 9 and reqs[1].prompt == "b"
    for line, needle in [('{"arrival_s": -1, "prompt": "a"}', "arrival_s"),
                         ('{"arrival_s": 0, "prompt": "a", "prompt_tokens": 3}', "exactly one"),
                         ('{"arrival_s": 0, "prompt": "a", "speed": 1}', "unknown keys"),
                         ("not json", "not JSON")]:
        trace.write_text('{"arrival_s": 0, "prompt": "ok"}\n' + line + "\n")
        with pytest.raises(TraceError, match=rf"t.jsonl:2: .*{needle}"):
            w.requests()
    with pytest.raises(TraceError, match="workload.trace"):
        build_workloads(spec(kind="replay"), vocab=128)
    with pytest.raises(TraceError, match="does not exist"):
        prepare(build_workloads(spec(kind="replay", trace=str(tmp_path / "missing.jsonl")), vocab=128))


def test_latency_metrics_and_draft_metrics_only_when_reported():
    results = [ok(prompt_tokens=10, completion_tokens=4, ttft_s=0.1, latency_s=0.4, itl_s=[0.1, 0.1, 0.1]),
               ok(prompt_tokens=20, completion_tokens=2, ttft_s=0.3, latency_s=0.5, itl_s=[0.2]),
               RequestResult(ok=False, error="x")]
    m = latency_metrics(results, wall_s=2.0)
    assert (m["requests"], m["errors"], m["prompt_tokens"], m["output_tokens"]) == (3, 1, 30, 6)
    assert m["prompt_throughput_tok_s"] == 15 and m["output_throughput_tok_s"] == 3
    assert m["ttft_mean_s"] == pytest.approx(0.2) and m["itl_p50_s"] == pytest.approx(0.1)
    assert "draft_acceptance_rate" not in m
    drafted = [ok(num_draft_tokens=8, num_accepted_draft_tokens=6, num_verify_steps=2),
               ok(num_draft_tokens=4, num_accepted_draft_tokens=0, num_verify_steps=1)]
    d = draft_metrics(drafted)
    assert d["draft_acceptance_rate"] == 0.5 and d["tokens_per_forward"] == (6 + 3) / 3


def paced_server(delay: float, words: tuple[str, ...] = ("a", "b", "c")) -> FastAPI:
    """Streams one chunk per word ``delay`` apart, and records how many requests were in
    flight at once and each prompt in arrival order. Asked for token ids, it answers ids
    read off the prompt (its length, then its last token), so a follow-up shows which
    answer it was built from."""
    app = FastAPI()
    app.state.live = app.state.peak = 0
    app.state.prompts = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        app.state.prompts.append(prompt)
        app.state.live += 1
        app.state.peak = max(app.state.peak, app.state.live)
        ids = [len(prompt) % 100] + [prompt[-1]] * (len(words) - 1) if body.get("return_token_ids") else []

        async def chunks():
            try:
                for i, word in enumerate(words):
                    await asyncio.sleep(delay)
                    choice = {"text": word, "finish_reason": None} | ({"token_ids": ids[i:i + 1]} if ids else {})
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(words)}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
            finally:
                app.state.live -= 1

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_driver_measures_first_token_and_gaps_and_caps_concurrency():
    from pdflow.bench.workloads import WorkRequest

    app = paced_server(0.05)
    with ServerThread(app) as server:
        target = Target(url=server.url, model="m")
        reqs = [WorkRequest(prompt=[1, 2, 3], max_tokens=3) for _ in range(6)]
        start = time.perf_counter()
        results, wall = asyncio.run(drive(target, reqs, concurrency=2, timeout_s=30))
        elapsed = time.perf_counter() - start
    assert app.state.peak == 2
    assert all(r.ok and r.text == "abc" and r.completion_tokens == 3 and r.prompt_tokens == 3 for r in results)
    assert all(r.ttft_s >= 0.05 and len(r.itl_s) == 2 and min(r.itl_s) >= 0.04 for r in results)
    assert 3 * 3 * 0.05 <= wall <= elapsed  # three waves of two, each three chunks


def test_runner_refuses_when_every_request_failed():
    (w,) = build_workloads(spec(kind="prefill", num_requests=2, prompt_tokens=4), vocab=128)
    # No /v1/completions there: every request is a 404.
    with ServerThread(FastAPI()) as server, pytest.raises(WorkloadFailed, match="all 2 prefill requests failed"):
        asyncio.run(run_workloads(Target(url=server.url, model="m"), prepare([w]),
                                  spec(kind="prefill", num_requests=2)))


def test_runner_keeps_each_workloads_own_figures_beside_the_prefixed_flat_metrics():
    """``accuracy`` (arith then needle) against a server that answers "abc": the table's
    rows come from ``per_workload``, unprefixed, with each workload's accuracy metric."""
    s = spec(kind="accuracy", num_requests=1, k_shot=0, context_len=1024, max_tokens=320, depths=[0.5],
             concurrency=2)
    with ServerThread(paced_server(0.0)) as server:
        result = asyncio.run(run_workloads(Target(url=server.url, model="m"), prepare(build_workloads(s, vocab=128)),
                                           s))
    assert list(result.per_workload) == ["arith", "needle"]
    for name, own in result.per_workload.items():
        assert own["requests"] == result.metrics[f"{name}_requests"] and own["errors"] == 0
        assert own["ttft_p50_s"] == result.metrics[f"{name}_ttft_p50_s"]
        assert "arith_ttft_p50_s" not in own and "needle_ttft_p50_s" not in own
    assert result.per_workload["arith"]["accuracy"] == result.metrics["arith_strict"] == 0.0
    assert result.per_workload["needle"]["accuracy"] == result.metrics["needle_accuracy"] == 0.0


def test_multiturn_later_turns_repeat_the_turn_before_in_round_order():
    (w,) = build_workloads(spec(kind="multiturn", num_requests=15, conversations=5, prompt_tokens=64,
                                prefix_reuse=0.8, max_tokens=3, fold_answers=False), vocab=128, block_tokens=16,
                           kv_bytes_per_block=100)
    reqs = w.requests()
    assert [r.meta["turn"] for r in reqs] == [0] * 5 + [1] * 5 + [2] * 5
    last = {}
    for r in reqs:
        c = r.meta["conversation"]
        if c in last:
            assert r.prompt[: len(last[c])] == last[c]
            assert len(last[c]) / len(r.prompt) == pytest.approx(0.8, abs=0.02)
        last[c] = r.prompt
    assert [r.meta["conversation"] for r in reqs[5:10]] != [r.meta["conversation"] for r in reqs[:5]]  # shuffled
    (fresh,) = build_workloads(spec(kind="multiturn", num_requests=4, conversations=2, prompt_tokens=32,
                                    prefix_reuse=0.0, fold_answers=False), vocab=128)
    assert all(len(r.prompt) == 32 for r in fresh.requests())
    task, _ = w.score(reqs[:2], [ok(prompt_tokens=80, cached_tokens=64), ok(prompt_tokens=64, cached_tokens=0)])
    assert task["multiturn_cache_hit_rate"] == pytest.approx(64 / 144)
    assert task["multiturn_kv_bytes_per_request"] == pytest.approx((1 + 4) * 100 / 2)


def test_multiturn_hit_rate_bounds_the_routing_ratio_by_the_workloads_shape():
    """One instance: placing at random is the best (every turn meets its previous one).
    The best is each turn's previous prompt in full blocks over all prompt tokens; with
    more instances random placement finds less (the acceptance's 2 at 80%: ~1.3x apart).
    With answers folded, a turn also finds the answer before it (less its last token)."""
    (w,) = build_workloads(spec(kind="multiturn", num_requests=30, conversations=5, prompt_tokens=128,
                                prefix_reuse=0.8, max_tokens=3, fold_answers=False), vocab=128, block_tokens=16)
    reqs = w.requests()
    rows = [{"prompt_tokens": len(r.prompt), "completion_tokens": 3} | r.meta for r in reqs]
    turns = turn_lengths(rows, answers_folded=False)
    best, one = hit_rate_bounds(turns, 1, 16, trials=50)
    assert one == pytest.approx(best)
    lens = sorted(len(r.prompt) for r in reqs if r.meta["conversation"] == 0)
    want = sum(n // 16 * 16 for n in lens[:-1]) / sum(lens)  # every conversation has the same lengths
    assert best == pytest.approx(want)
    _, two = hit_rate_bounds(turns, 2, 16)
    _, four = hit_rate_bounds(turns, 4, 16)
    assert best > two > four
    assert 1.2 < best / two < 1.45 and best / four > 1.5
    folded = turn_lengths([{"conversation": 0, "turn": 0, "prompt_tokens": 30, "completion_tokens": 4},
                           {"conversation": 0, "turn": 1, "prompt_tokens": 43, "completion_tokens": 4}], True)
    assert folded == {0: [(30, 33), (43, 46)]}
    assert hit_rate_bounds(folded, 1, 16, trials=1)[0] == pytest.approx(32 / 73)  # 33 held: 2 full blocks


def test_multiturn_folds_each_answer_into_the_next_turn():
    """Closed loop: the first turns only, shuffled; a follow-up is the prompt, the answer's
    ids and new tokens making the repeated part 80%; the same whatever order answers came
    in; none after a conversation's last turn or a failed one; an answer without its ids
    is refused (re-tokenizing the text could differ from what the decode instance holds)."""
    s = spec(kind="multiturn", num_requests=7, conversations=3, prompt_tokens=40, prefix_reuse=0.8, max_tokens=4)
    (w,) = build_workloads(s, vocab=128)
    first = w.requests()
    assert w.closed_loop and sorted(r.meta["conversation"] for r in first) == [0, 1, 2]
    assert all(len(r.prompt) == 40 and r.return_token_ids and r.meta["turn"] == 0 for r in first)
    assert [w.turns_of(c) for c in range(3)] == [3, 2, 2]
    answer = ok(completion_tokens=4, token_ids=[5, 6, 7, 8])
    nxt = w.follow_up(first[0], answer)
    history = first[0].prompt + [5, 6, 7, 8]
    assert nxt.prompt[:44] == history and len(nxt.prompt) == 44 + 11 and nxt.meta["turn"] == 1
    assert nxt.meta["conversation"] == first[0].meta["conversation"]
    (again,) = build_workloads(s, vocab=128)
    assert again.follow_up(again.requests()[0], answer).prompt == nxt.prompt
    c2 = next(r for r in first if r.meta["conversation"] == 2)
    assert w.follow_up(w.follow_up(c2, answer), answer) is None  # conversation 2 has two turns
    assert w.follow_up(c2, RequestResult(ok=False, error="HTTP 500")) is None
    with pytest.raises(WorkloadFailed, match="return_token_ids"):
        w.follow_up(c2, ok(completion_tokens=4))


def test_runner_drives_multiturn_closed_loop_with_each_answer_in_the_next_prompt():
    """Every turn is sent, each only after the answer it extends came back, at most
    ``concurrency`` in flight; a follow-up's prompt holds its answer's ids (the server's
    own), and the rows are the requests as sent."""
    s = spec(kind="multiturn", num_requests=9, conversations=4, prompt_tokens=20, prefix_reuse=0.5,
             max_tokens=2, concurrency=2, progress=False)
    app = paced_server(0.01, words=("x", "y"))
    with ServerThread(app) as server:
        result = asyncio.run(run_workloads(Target(url=server.url, model="m"), prepare(build_workloads(s, vocab=128)),
                                           s))
    rows = result.rows
    assert len(rows) == 9 and all(r["ok"] for r in rows) and app.state.peak == 2
    assert sorted((r["conversation"], r["turn"]) for r in rows) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                                     (2, 0), (2, 1), (3, 0), (3, 1)]
    by_turn = {(r["conversation"], r["turn"]): r for r in rows}
    for (c, t), r in by_turn.items():
        if t:
            before = by_turn[(c, t - 1)]
            assert r["sent_at_s"] >= before["sent_at_s"] + before["latency_s"]
            assert r["prompt_tokens"] == 2 * (before["prompt_tokens"] + 2)  # reuse 0.5: as many new tokens
    for prompt in app.state.prompts:
        if len(prompt) > 20:  # a follow-up: its history ends with the answer to the turn before
            n = len(prompt) // 2
            history = prompt[:n]
            assert history[-2:] == [(n - 2) % 100, history[-3]]


def test_think_time_holds_each_follow_up_back_by_a_seeded_time():
    """With ``think_time_s`` a follow-up is due a seeded, positive think time after its
    answer (the same whatever the timing) and is not sent before; without it, at once."""
    s = spec(kind="multiturn", num_requests=6, conversations=2, prompt_tokens=20, prefix_reuse=0.5, max_tokens=2,
             concurrency=1, progress=False, think_time_s=0.05)
    with ServerThread(paced_server(0.005, words=("x", "y"))) as server:
        (w,) = build_workloads(s, vocab=128)
        sent, results, _ = asyncio.run(drive_turns(Target(url=server.url, model="m"), w.requests(), w.follow_up,
                                                   concurrency=1, timeout_s=30, progress=False))
    assert len(sent) == 6 and all(r.ok for r in results)
    pairs = list(zip(sent, results, strict=True))
    answered = {(q.meta["conversation"], q.meta["turn"]): r.sent_at_s + r.latency_s for q, r in pairs}
    thinks = {}
    for q, r in pairs:
        c, t = q.meta["conversation"], q.meta["turn"]
        if t:
            thinks[(c, t)] = q.arrival_s - answered[(c, t - 1)]
            assert thinks[(c, t)] > 0 and r.sent_at_s >= q.arrival_s
        else:
            assert q.arrival_s is None
    assert len(set(thinks.values())) == 4
    (again,) = build_workloads(s, vocab=128)
    first = again.requests()[0]
    late = RequestResult(ok=True, completion_tokens=2, token_ids=[1, 2], sent_at_s=10.0, latency_s=1.0)
    assert again.follow_up(first, late).arrival_s - 11.0 == pytest.approx(thinks[(first.meta["conversation"], 1)])
    (at_once,) = build_workloads(dataclasses.replace(s, think_time_s=0.0), vocab=128)
    assert at_once.follow_up(at_once.requests()[0], late).arrival_s is None
    with pytest.raises(ValueError, match="think_time_s must be >= 0"):
        spec(kind="multiturn", think_time_s=-1.0)


def test_closed_loop_sends_a_ready_turn_before_one_whose_user_still_thinks():
    """One slot, two conversations: a's follow-up came first but is due 0.3 s after its
    answer; b's, ready at once, goes before it (the ready queue is ordered by when a turn
    is due, not by when it was made), and a's waits until it is due."""
    a0, b0 = (WorkRequest(prompt=[1, 2, 3], max_tokens=2, meta={"name": n}) for n in ("a0", "b0"))

    def follow_up(req, result):
        name = req.meta["name"]
        if name == "a0":
            return WorkRequest(prompt=[1], max_tokens=2, meta={"name": "a1"},
                               arrival_s=result.sent_at_s + result.latency_s + 0.3)
        return WorkRequest(prompt=[2], max_tokens=2, meta={"name": "b1"}) if name == "b0" else None

    with ServerThread(paced_server(0.005, words=("x",))) as server:
        sent, results, _ = asyncio.run(drive_turns(Target(url=server.url, model="m"), [a0, b0], follow_up,
                                                   concurrency=1, timeout_s=30, progress=False))
    assert [q.meta["name"] for q in sent] == ["a0", "b0", "b1", "a1"]
    assert results[3].sent_at_s >= sent[3].arrival_s


def test_multiturn_first_turns_share_the_system_prompt_and_nothing_after_it():
    """Every conversation's first turn starts with the same ``system_prompt_tokens`` (its
    length counted in ``prompt_tokens``), in both loops; without one, as before."""
    for fold in (True, False):
        s = spec(kind="multiturn", num_requests=8, conversations=4, prompt_tokens=40, system_prompt_tokens=24,
                 fold_answers=fold)
        (w,) = build_workloads(s, vocab=128)
        firsts = [r.prompt for r in w.requests() if r.meta["turn"] == 0]
        assert len(firsts) == 4 and all(len(p) == 40 and p[:24] == firsts[0][:24] for p in firsts)
        assert len({tuple(p[24:26]) for p in firsts}) == 4
        (plain,) = build_workloads(spec(kind="multiturn", num_requests=8, conversations=4, prompt_tokens=40,
                                        fold_answers=fold), vocab=128)
        assert len({tuple(r.prompt[:24]) for r in plain.requests() if r.meta["turn"] == 0}) == 4
    with pytest.raises(ValueError, match="system_prompt_tokens must be >= 0 and below prompt_tokens"):
        spec(kind="multiturn", prompt_tokens=40, system_prompt_tokens=40)

