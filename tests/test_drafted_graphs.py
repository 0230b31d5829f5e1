"""The drafted-step graph runner's buffers, padding and bookkeeping on CPU: run eagerly
over its padded buckets (capture off: the very code a GPU captures), steady drafted
steps must give the tokens, acceptance and drafts of ``Drafting.step``; a wrong anchor
inside it is caught by acceptance; steps the buckets cannot hold run as before."""

from __future__ import annotations

import pytest
import torch

from pdflow import SamplingParams
from pdflow.bench.step_trace import StepTrace
from pdflow.bench.tasks import arith_eval_set
from pdflow.engine.llm import LLM
from pdflow.parallel.messages import SamplingSpec, StepInput
from pdflow.spec.load import compose_spec
from pdflow.worker.drafted_graphs import DraftedGraphRunner

BASE = ["mode=monolithic", "prefill=tp1", "decode=tp1", "tracking=off", "drafter=dspark"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [it.prompt for it in arith_eval_set(3, k_shot=2, seed=11)]  # bucket 4: one padding sequence


def _summary(outs):
    return [(o.token_ids, o.num_drafted, o.num_accepted, o.num_verify_steps) for o in outs]


@pytest.fixture(scope="module")
def llm():
    with LLM.from_run_spec(compose_spec(BASE), role="decode") as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm):
    assert llm.engine.instance.executor.stage.drafted_graphs is None  # CPU: nothing captured by default
    outs = llm.generate(PROMPTS, GREEDY)
    return _summary(outs), outs


def _with_runner(llm, max_batch: int, buckets=None):
    stage = llm.engine.instance.executor.stage
    runner = DraftedGraphRunner(stage.runner, stage.drafting, max_batch=max_batch, block_table_width=64,
                                buckets=buckets, capture=False)
    stage.drafted_graphs = runner
    return stage, runner


def test_buffered_drafted_steps_equal_the_eager_drafting(llm, reference):
    stage, runner = _with_runner(llm, max_batch=4)
    try:
        with StepTrace(llm.engine) as trace:
            outs = llm.generate(PROMPTS, GREEDY)
    finally:
        stage.drafted_graphs = None
    got, ref_outs = _summary(outs), reference[1]
    reference = reference[0]
    assert got == reference
    for out, want in zip(outs, ref_outs, strict=True):  # the emitted tokens' logprobs, in order
        assert out.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert sum(o[2] for o in got) > 0  # the shipped drafter's runs were accepted
    through = [r for r in trace.records if r.drafted_graph]
    assert len(through) == runner.replays >= 2  # steady steps went through bucket 4
    assert all(r.drafted and r.seqs == 3 for r in through)
    assert f"({runner.replays} in drafted graphs)" in trace.summary()


def test_a_wrong_anchor_in_the_buffered_step_is_caught(llm, reference, monkeypatch):
    """Proposing from one position too far keeps the output lossless (verification) but
    not the acceptance: the comparison above would catch such a step."""
    stage, runner = _with_runner(llm, max_batch=4)
    drafter = stage.drafting.drafter
    real = drafter.propose_device
    monkeypatch.setattr(drafter, "propose_device", lambda ids, anchors, *a: real(ids, anchors + 1, *a))
    try:
        got = _summary(llm.generate(PROMPTS, GREEDY))
    finally:
        stage.drafted_graphs = None
    assert runner.replays >= 2
    assert [o[0] for o in got] == [o[0] for o in reference[0]]
    assert got != reference[0]


def test_steps_the_buckets_cannot_hold_run_as_before(llm, reference):
    stage, runner = _with_runner(llm, max_batch=2)
    try:
        assert _summary(llm.generate(PROMPTS, GREEDY)) == reference[0]
    finally:
        stage.drafted_graphs = None
    assert runner.replays == 0  # three requests never fit a bucket of two


def test_padding_sequences_write_no_cache(llm):
    """A bucket's padding sequences attend over block 0 (held by a real request) but must
    write nothing there: one real sequence that writes nothing (slots -1) in bucket 4
    leaves every target and draft cache as it was."""
    stage, runner = _with_runner(llm, max_batch=4, buckets=[4])
    stage.drafted_graphs = None
    k1 = runner.k + 1
    msg = StepInput(step=0, seq_ids=["x"], token_ids=[5] * k1, positions=list(range(40, 40 + k1)),
                    slot_mapping=[-1] * k1, cu_seqlens_q=[0, k1], context_lens=[40 + k1], block_tables=[[0, 1]],
                    sample_rows=[k1 - 1], sample_seq_ids=["x"], sampling=[SamplingSpec()], num_drafts=[k1 - 1],
                    next_token_ids=[-1], context_adopt=[-1])
    assert runner.applies(msg)
    caches = [*stage.kv.caches.values(), *stage.draft_kv.caches.values()]
    kept = [c[:2].clone() for c in caches]  # blocks 0 and 1: all a stray write could reach
    gen = torch.Generator().manual_seed(0)
    for c in caches:  # entries a stray write would change (the pad token's K/V may be zeros)
        c[:2] = torch.randn(c[:2].shape, generator=gen)
    before = [c[:2].clone() for c in caches]
    try:
        out = runner.forward(msg)
        assert out.shape == (4, 3 * k1) and runner.replays == 1
        assert all(torch.equal(c[:2], b) for c, b in zip(caches, before, strict=True))
    finally:
        for c, k in zip(caches, kept, strict=True):
            c[:2] = k
