"""Speculative decoding through the engine, one process: the last stage drafts, the
target verifies [anchor, drafts] in one forward, the owner appends accepted runs.

Random drafters (acceptance ~0) show losslessness on the reject path; an oracle drafter
(the true continuation, some tokens corrupted) drives the accept path, runs cut by a
stop token and the per-request counts."""

from __future__ import annotations

import pytest
import torch

from pdflow import SamplingParams
from pdflow.engine.llm import LLM
from pdflow.graph import PRODUCER, build_graph
from pdflow.spec.load import compose_spec
from pdflow.spec_decode import Eagle3UnderPP, Proposal
from pdflow.worker.stage import build_stage

PROMPTS = ["12+34=", "hello world"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = ["mode=monolithic", "prefill=tp1", "decode=tp1", "tracking=off", "decode.max_num_batched_tokens=64"]


def _llm(drafter: str, *extra: str, role: str = "decode") -> LLM:
    more = ["drafter.path=random"] if drafter != "none" else []
    return LLM.from_run_spec(compose_spec([*BASE, f"drafter={drafter}", *more, *extra]), role=role)


@pytest.fixture(scope="module")
def plain():
    with _llm("none") as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def dspark():
    with _llm("dspark") as llm:
        yield llm


def _check_counts(outs, params):
    for o in outs:
        assert 0 <= o.num_accepted <= o.num_drafted
        assert o.num_verify_steps >= 1
        # Every decode forward emitted accepted + 1 tokens; the prefill emitted the first.
        if o.finish_reason == "length":
            assert len(o.token_ids) == 1 + o.num_accepted + o.num_verify_steps
        assert o.tokens_per_forward == pytest.approx((o.num_accepted + o.num_verify_steps) / o.num_verify_steps)


@pytest.mark.parametrize("kind", ["dspark", "eagle", "eagle3"])
def test_greedy_with_a_random_drafter_equals_greedy_without(kind, reference, dspark):
    if kind == "dspark":
        outs = dspark.generate(PROMPTS, GREEDY)
    else:
        with _llm(kind) as llm:
            outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    _check_counts(outs, GREEDY)
    assert sum(o.num_drafted for o in outs) > 0


def _oracle(llm: LLM, continuation: dict[int, list[int]], corrupt_every: int):
    """Make the stage's drafter propose the reference continuation (every
    ``corrupt_every``-th draft wrong), keyed by the prompt's first token."""
    drafter = llm.instance.executor.stage.drafting.drafter
    real = drafter._propose
    seqs = {}

    def propose(batch):
        real(batch)  # keep the drafter's own work (chain entries) exactly as it runs
        k, vocab = batch.num_drafts, llm.engine.config.vocab_size
        rows = []
        for sid, pos in zip(batch.seq_ids, batch.anchor_positions, strict=True):
            seq = seqs.setdefault(sid, llm.engine.scheduler.find(sid))
            full = seq.prompt_token_ids + continuation[seq.prompt_token_ids[0]]
            drafts = (full[pos + 1:pos + 1 + k] + [0] * k)[:k]
            rows.append([(t + 1) % vocab if (pos + j) % corrupt_every == 0 else t for j, t in enumerate(drafts)])
        tokens = torch.tensor(rows, dtype=torch.int64)
        return Proposal(tokens=tokens, probs=None, logits=torch.zeros(len(rows), k, vocab))

    drafter._propose = propose
    return lambda: setattr(drafter, "_propose", real)


def test_accepted_runs_are_lossless_and_stop_mid_run(dspark, plain, reference):
    continuation = {plain.tokenizer.encode(p)[0]: r for p, r in zip(PROMPTS, reference, strict=True)}
    restore = _oracle(dspark, continuation, corrupt_every=7)
    try:
        outs = dspark.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        _check_counts(outs, GREEDY)
        assert sum(o.num_accepted for o in outs) >= len(PROMPTS) * 4  # the accept path ran (random drafts: ~0)
        # A stop token inside an accepted run ends the request there, as without drafts.
        stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[reference[0][6]])
        want = plain.generate(PROMPTS[:1], stop)[0]
        got = dspark.generate(PROMPTS[:1], stop)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        assert len(got.token_ids) < 12
    finally:
        restore()
    assert dspark.engine.acceptance.accepted >= sum(o.num_accepted for o in outs)
    assert dspark.num_free_kv_blocks == dspark.num_kv_blocks


def test_sampled_requests_run_speculative_sampling_reproducibly(dspark):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    first = dspark.generate(PROMPTS[:2], params)
    again = dspark.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 8 and all(0 <= t < 128 for t in o.token_ids) for o in first)
    _check_counts(first, params)


class _Calls:
    def __init__(self, drafter):
        self.propose = self.commit = 0
        for name in ("propose", "commit"):
            real = getattr(drafter, name)
            setattr(drafter, name, self._count(name, real))

    def _count(self, name, real):
        def call(*args, **kwargs):
            setattr(self, name, getattr(self, name) + 1)
            return real(*args, **kwargs)
        return call


@pytest.mark.parametrize(("kind", "proposes"), [("dspark", False), ("eagle", True)])
def test_producer_duties(kind, proposes, reference):
    with _llm(kind, "mode=pd", role=PRODUCER) as llm:  # monolithic plans no prefill side
        calls = _Calls(llm.instance.executor.stage.drafting.drafter)
        first = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1))
        assert calls.commit == llm.engine.steps  # every target step commits
        assert (calls.propose > 0) is proposes
        assert [o.token_ids for o in first] == [r[:1] for r in reference]
        assert all(o.num_drafted == 0 for o in first)  # a producer keeps no drafts


def test_eagle3_under_pp_is_refused_by_the_runtime_too():
    spec = compose_spec([*BASE, "decode.pp=2", "drafter=eagle3", "drafter.path=random"])
    graph = build_graph(spec)  # refused (EAGLE3_UNDER_PP), but placed: build its last stage anyway
    last = graph.instance("decode").stages[-1].ranks[0].rank
    with pytest.raises(Eagle3UnderPP, match="pp=2"):
        build_stage(graph, "decode", last, torch.device("cpu"))


def test_a_pp_last_stage_without_tap_layers_captures_none():
    """dspark taps all on stage 0: the last stage drafts from relayed taps only."""
    spec = compose_spec([*BASE, "decode.pp=2", "drafter=dspark", "drafter.path=random", "drafter.taps=[1,2]"])
    graph = build_graph(spec).raise_if_refused()
    last = graph.instance("decode").stages[-1].ranks[0].rank
    stage = build_stage(graph, "decode", last, torch.device("cpu"))
    assert stage.runner.capture_layers == () and stage.drafting is not None
    stage.release()


def test_top_logprobs_of_accepted_drafts_equal_those_without_a_drafter(plain):
    """Each emitted token's top k comes from the verify's logits row that scored it."""
    from pdflow.bench.tasks.evalsets import arith_eval_set

    prompts = [item.prompt for item in arith_eval_set(2, k_shot=1)]
    ask = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = plain.generate(prompts, ask)
    with LLM.from_run_spec(compose_spec([*BASE, "drafter=dspark"]), role="decode") as llm:  # the shipped one
        got = llm.generate(prompts, ask)
    assert sum(o.num_accepted for o in got) > 0  # runs of several tokens per forward were scored
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert len(g.top_logprobs) == len(g.token_ids)
        for a, b in zip(g.top_logprobs, w.top_logprobs, strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)
