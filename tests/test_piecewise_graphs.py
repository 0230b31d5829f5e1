"""The piecewise graph runner's pieces, buffers and padding on CPU: run without capturing
(the very calls a GPU captures), prefill, mixed and decode steps of the shipped model must
give the eager forward's tokens and logprobs, drafter taps included; a piece that reads
the wrong layer's weights, or padding rows that reach the output, are caught."""

from __future__ import annotations

import pytest

from pdflow import SamplingParams
from pdflow.bench.tasks import arith_eval_set
from pdflow.engine.llm import LLM
from pdflow.spec.load import compose_spec
from pdflow.worker.piecewise_graphs import PiecewiseGraphRunner, piecewise_buckets

BASE = ["mode=monolithic", "prefill=tp1", "decode=tp1", "tracking=off", "decode.enable_prefix_caching=false"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [it.prompt for it in arith_eval_set(3, k_shot=2, seed=5)]


def _summary(outs):
    return [(o.token_ids, o.num_drafted, o.num_accepted) for o in outs]


@pytest.fixture(scope="module", params=["none", "dspark"])
def llm(request):
    with LLM.from_run_spec(compose_spec([*BASE, f"drafter={request.param}"]), role="decode") as engine:
        yield engine


def _piecewise(llm, buckets=(16, 48, 256)) -> tuple[object, PiecewiseGraphRunner]:
    stage = llm.engine.instance.executor.stage
    dtype = next(stage.model.parameters()).dtype
    runner = PiecewiseGraphRunner(stage.runner, max_tokens=max(buckets), dtype=dtype, graphs=False,
                                  buckets=list(buckets))
    stage.piecewise = runner
    return stage, runner


def test_buckets_cover_the_budget_with_at_most_a_third_padding():
    sizes = piecewise_buckets(8192)
    assert sizes[:3] == [16, 32, 64] and sizes[-1] == 8192
    assert all(b / a <= 1.5 for a, b in zip(sizes[2:], sizes[3:], strict=False))
    assert piecewise_buckets(100)[-1] == 100 and piecewise_buckets(10) == [10]


def test_steps_in_pieces_equal_the_eager_forward(llm):
    stage = llm.engine.instance.executor.stage
    assert stage.piecewise is None  # CPU: nothing captured by default
    want = llm.generate(PROMPTS, GREEDY)
    _, runner = _piecewise(llm)
    try:
        got = llm.generate(PROMPTS, GREEDY)
    finally:
        stage.piecewise = None
    assert _summary(got) == _summary(want)
    for out, ref in zip(got, want, strict=True):
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert runner.replays > 0
    if stage.runner.capture_layers:  # the drafter's taps rode the pieces: its acceptance held
        assert sum(o.num_accepted for o in got) > 0


def test_a_piece_with_the_wrong_layer_is_caught(llm):
    """Layer 1 run where layer 2 belongs: no error, and the trained tiny model even keeps
    its greedy tokens, but not their logprobs, which the equality above compares."""
    want = llm.generate(PROMPTS, GREEDY)
    stage, runner = _piecewise(llm)
    runner.layers[2] = (runner.layers[2][0], runner.layers[1][1])
    try:
        got = llm.generate(PROMPTS, GREEDY)
    finally:
        stage.piecewise = None
    assert runner.replays > 0
    n = min(len(got[0].logprobs), len(want[0].logprobs))
    assert max(abs(a - b) for a, b in zip(got[0].logprobs[:n], want[0].logprobs[:n], strict=True)) > 1e-3


def test_padding_rows_never_reach_the_output(llm):
    """Garbage in the padding rows (a previous, longer step's values) changes nothing."""
    want = _summary(llm.generate(PROMPTS, GREEDY))
    stage, runner = _piecewise(llm, buckets=(256,))
    runner.inputs.fill_(7)
    runner.residual.fill_(1e3)
    runner.qkv.fill_(-5.0)
    runner.attn_out.fill_(3.0)
    try:
        got = _summary(llm.generate(PROMPTS, GREEDY))
    finally:
        stage.piecewise = None
    assert got == want
