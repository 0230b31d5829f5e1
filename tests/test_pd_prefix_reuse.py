"""Decode-side prefix reuse and local prefill under ``pdflow.Deployment``: a later turn of
a conversation moves only the blocks the consumer's prefix cache lacks, reports the
consumer's cached tokens, and decodes the same greedy tokens as reuse off and as one
process. An export that ignores where the suffix starts is caught by the outputs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pdflow import Deployment, SamplingParams, compose
from pdflow.engine import llm_engine

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SPEC = ["drafter=none", "prefill=tp1", "decode=tp1", "tracking=off", "prefill.block_size=16",
        "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.num_kv_blocks=48", "decode.num_kv_blocks=48"]


def _turns(seed: int, vocab=128):
    """Turn one (70 tokens: 4 full blocks), then two follow-ups of 100 tokens that extend
    it (7 blocks, the first 4 shared). Each test its own seed: the deployment's caches
    are shared between tests."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(4, vocab, (70,), generator=gen).tolist()
    return first, [first + torch.randint(4, vocab, (30,), generator=gen).tolist() for _ in range(2)]


def _serve(d, seed, *, prefix_reuse=True, local_prefill_tokens=0, patch=None):
    """Turn one, then the follow-ups: tokens, the follow-ups' cached counts, blocks exported
    for the follow-ups, and the consumer's admission counts since."""
    router = d.spec.router
    router.prefix_reuse, router.local_prefill_tokens = prefix_reuse, local_prefill_tokens
    first, later = _turns(seed)
    try:
        outs = d.generate([first], GREEDY)
        sent = d.producer.exported_blocks if d.producer is not None else 0
        before = dataclasses.replace(d.reuse)
        if patch is not None:
            patch()
        outs += d.generate(later, GREEDY)
    finally:
        router.prefix_reuse, router.local_prefill_tokens = True, 0
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert all(free == total for free, total in ((e.num_free_kv_blocks, e.num_kv_blocks)
                                                 for e in (d.producer, d.consumer) if e is not None))
    exported = (d.producer.exported_blocks - sent) if d.producer is not None else 0
    counts = {f.name: getattr(d.reuse, f.name) - getattr(before, f.name) for f in dataclasses.fields(before)}
    return [o.token_ids for o in outs], [o.num_cached_prompt_tokens for o in outs[1:]], exported, counts


@pytest.fixture(scope="module")
def one_process():
    with Deployment(compose([*SPEC, "mode=monolithic"])) as d:
        return {seed: _serve(d, seed)[0] for seed in (1, 2, 3, 4)} | {
            "chat": _chat(d, 5)[0], "chat_off": _chat(d, 6, factor=0)[0], "held": _chat(d, 7, news=(40,))[0]}


def _chat(d, seed, *, factor=2.0, news=(24, 14, 30)):
    """A conversation whose answers fold into the next turn (local prefill below 40
    tokens): turn one (70 tokens) remote, turns two and three (36 and 24 uncached) local,
    so the producer never computed their blocks; turn four's uncached part is 44 tokens
    (not short), while a producer would recompute 92 (from turn one's 64 on). Tokens of
    every turn, the last turn's cached count, blocks exported for it, admission counts for
    it. ``news``: the tokens each later turn adds after the answer."""
    router = d.spec.router
    router.local_prefill_tokens, router.local_prefill_factor = 40, factor
    gen = torch.Generator().manual_seed(seed)
    prompt, outs = torch.randint(4, 128, (70,), generator=gen).tolist(), []
    try:
        for new in news:
            outs += d.generate([prompt], GREEDY)
            prompt = prompt + outs[-1].token_ids + torch.randint(4, 128, (new,), generator=gen).tolist()
        sent = d.producer.exported_blocks if d.producer is not None else 0
        before = dataclasses.replace(d.reuse)
        outs += d.generate([prompt], GREEDY)
    finally:
        router.local_prefill_tokens, router.local_prefill_factor = 0, 2.0
    assert all(o.error is None for o in outs), [o.error for o in outs]
    exported = (d.producer.exported_blocks - sent) if d.producer is not None else 0
    counts = {f.name: getattr(d.reuse, f.name) - getattr(before, f.name) for f in dataclasses.fields(before)}
    return [o.token_ids for o in outs], outs[-1].num_cached_prompt_tokens, exported, counts


@pytest.fixture(scope="module")
def pd():
    with Deployment(compose(SPEC)) as d:
        yield d


def test_reuse_moves_only_the_suffix_and_decodes_the_same_tokens(one_process, pd):
    tokens, cached, exported, counts = _serve(pd, 1)
    assert tokens == one_process[1]
    assert cached == [64, 64]  # the consumer's own 4 blocks of turn one
    assert exported == 2 * 3  # 7 blocks each, 4 of them cached on the consumer
    assert counts["reused_tokens"] == 128 and counts["local_prefills"] == 0
    off, cached_off, exported_off, _ = _serve(pd, 2, prefix_reuse=False)
    assert off == one_process[2]
    assert exported_off == 2 * 7 and cached_off == [0, 0]


def test_short_uncached_part_prefills_on_the_consumer(one_process, pd):
    tokens, cached, exported, counts = _serve(pd, 3, local_prefill_tokens=40)  # 36 uncached
    assert tokens == one_process[3]
    assert exported == 0 and counts["local_prefills"] == 2
    assert cached == [64, 64]


def test_a_turn_whose_producer_would_recompute_the_conversation_prefills_locally(one_process, pd):
    """Turns prefilled locally leave the producer without their blocks: the next longer
    turn would have it recompute from turn one. With ``local_prefill_factor`` it is
    prefilled here (no transfer, counted); with the factor off it goes remote and moves
    its 3 uncached blocks. A turn whose prefix the producer computed (turn one, remote)
    still goes remote though as long (52 tokens here and there): the guess follows where
    blocks came from. All decode one process's tokens."""
    tokens, cached, exported, counts = _chat(pd, 5)
    assert tokens == one_process["chat"]
    assert cached == 112 and exported == 0
    assert counts["local_prefills"] == counts["local_for_producer_misses"] == 1
    off, cached_off, exported_off, counts_off = _chat(pd, 6, factor=0)
    assert off == one_process["chat_off"]
    assert cached_off == 112 and exported_off == 3
    assert counts_off["remote_prefills"] == 1 and counts_off["local_for_producer_misses"] == 0
    held, cached_held, exported_held, counts_held = _chat(pd, 7, news=(40,))
    assert held == one_process["held"]
    assert cached_held == 64 and exported_held == 4 and counts_held["remote_prefills"] == 1


def test_an_export_that_ignores_the_suffix_start_is_caught(one_process, pd, monkeypatch):
    real = llm_engine.build_step_input

    def from_block_zero(batch, **kw):  # the bug: the suffix's KV read from the prompt's first blocks
        step, sampled = real(batch, **kw)
        tables = {s.request_id: s.block_table for s in batch.seqs}
        for e in step.exports:
            e.src_blocks = tables[e.request_id][: len(e.dst_blocks)]
        return step, sampled

    tokens = _serve(pd, 4, patch=lambda: monkeypatch.setattr(llm_engine, "build_step_input", from_block_zero))[0]
    assert tokens[0] == one_process[4][0]
    assert tokens[1:] != one_process[4][1:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reuse_on_one_gpu_decodes_the_monolithic_tokens():
    """TP1 -> TP1 on one GPU (transfer=auto: cuda_ipc): the suffix-only export reads the
    producer's right blocks there too."""
    from pd_gpu_kit import GPU_BASE

    gpu = [*GPU_BASE, "decode.device_offset=0"]
    with Deployment(compose([*SPEC, *gpu, "mode=monolithic"])) as d:
        want = _serve(d, 5)[0]
    with Deployment(compose([*SPEC, *gpu])) as d:
        tokens, cached, exported, _ = _serve(d, 5)
    assert tokens == want and cached == [64, 64] and exported == 2 * 3
