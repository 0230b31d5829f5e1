"""Speculative decoding with the drafter on a multi-rank last stage: TP2 (every TP rank
drafts in lockstep), PP2 (taps relayed to the last stage, which has no embedding of its
own), and P/D PP2 -> TP2 through ``pdflow.Deployment`` (the producer writes the draft
context, the consumer adopts the transferred draft units). Greedy outputs equal one
process without a drafter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdflow import Deployment, SamplingParams, compose

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = ["prefill.block_size=32", "decode.block_size=32", "prefill.kv_page_tokens=16",
         "decode.kv_page_tokens=16", "prefill.num_kv_blocks=24", "decode.num_kv_blocks=24",
         "prefill.max_num_batched_tokens=64", "decode.max_num_batched_tokens=64", "tracking=off"]
DSPARK = ["drafter=dspark", "drafter.path=random"]
SHIPPED_DSPARK = Path(__file__).resolve().parents[1] / "pdflow" / "assets" / "tiny-dspark"


def _prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (5, 40)]


def _generate(overrides, prompts=None, params=GREEDY):
    with Deployment(compose([*SMALL, *overrides])) as d:
        outs = d.generate(prompts or _prompts(), params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        pools = [(e.num_free_kv_blocks, e.num_kv_blocks) for e in (d.producer, d.consumer) if e is not None]
        assert all(free == total for free, total in pools), "blocks leaked"
        return outs


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in _generate(["prefill=tp1", "decode=tp1", "mode=monolithic", "drafter=none"])]


def test_pp2_drafting_is_lossless(reference):
    """The drafter on the last of two stages (its own copy of the embedding, relayed taps);
    a TP2 last stage drafts in the P/D test below."""
    outs = _generate(["mode=monolithic", "prefill=tp1", "decode=tp1", "decode.pp=2", *DSPARK])
    assert [o.token_ids for o in outs] == reference
    for o in outs:
        assert 0 <= o.num_accepted <= o.num_drafted and o.num_verify_steps >= 1
        assert len(o.token_ids) == 1 + o.num_accepted + o.num_verify_steps


def test_pd_pp2_to_tp2_with_dspark_is_lossless(reference):
    """The PP2 producer writes draft context and never proposes; both TP2 consumer ranks
    adopt the transferred draft units (a missing entry raises ContextGap) and draft."""
    outs = _generate(["prefill=pp2", "decode=tp2", *DSPARK])
    assert [o.token_ids for o in outs] == reference
    # The consumer's first decode step has no drafts (the producer proposes none), later ones do.
    assert all(o.num_drafted > 0 and o.num_accepted <= o.num_drafted for o in outs)
    assert all(len(o.token_ids) == 1 + o.num_accepted + o.num_verify_steps for o in outs)


def _arith_prompts(n):
    from pdflow.bench.tasks import arith_eval_set

    return [p.prompt for p in arith_eval_set(n)]


@pytest.mark.skipif(not SHIPPED_DSPARK.is_dir(),
                    reason="needs trained drafter weights at pdflow/assets/tiny-dspark (random drafts accept ~0, "
                           "so a drop in acceptance cannot show)")
def test_wrong_draft_cut_drops_acceptance_and_stays_lossless():
    prompts = _arith_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=32)
    # Five-shot prompts (~1.7K tokens): pools and batches sized for them.
    roomy = ["prefill.num_kv_blocks=160", "decode.num_kv_blocks=160", "prefill.max_num_batched_tokens=2048",
             "decode.max_num_batched_tokens=2048"]
    pd = ["prefill=pp2", "decode=tp2", "drafter=dspark", *roomy]
    right = _generate(pd, prompts, params)
    wrong = _generate([*pd, "transfer.force_page_ignorant_cut=[draft]"], prompts, params)
    rate = lambda outs: sum(o.num_accepted for o in outs) / max(1, sum(o.num_drafted for o in outs))
    assert [o.token_ids for o in wrong] == [o.token_ids for o in right]  # lossless either way
    one = _generate(["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=dspark", *roomy], prompts, params)
    assert abs(rate(right) - rate(one)) < 0.05  # the right cut costs nothing
    assert rate(wrong) < rate(right) - 0.02, (rate(wrong), rate(right))
