"""Scheduling under pressure: preemption by recompute, token budgets, aborts, and block
accounting (every block comes back)."""

from __future__ import annotations

import pytest
import torch

from pdflow import LLM, SamplingParams
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("llama"), family="llama", init_std=0.3, seed=0
    )


def prompts(seed: int, lens=(21, 35, 12, 40, 28, 17)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=gen).tolist() for n in lens]


def make_llm(folder, **parallel) -> LLM:
    spec = dict(block_size=16, kv_page_tokens=16, num_kv_blocks=64, max_num_batched_tokens=256)
    spec.update(parallel)
    return LLM(str(folder), ParallelSpec(**spec), dtype="float32")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_small_pool_preempts_and_still_matches_large_pool(checkpoint, prefix_caching):
    batch = prompts(seed=5)
    roomy = make_llm(checkpoint, enable_prefix_caching=prefix_caching).generate(batch, GREEDY)
    assert sum(o.num_preemptions for o in roomy) == 0
    # Each request grows to 3-4 blocks; 6 requests cannot all hold theirs in 9 blocks.
    tight_llm = make_llm(checkpoint, num_kv_blocks=9, enable_prefix_caching=prefix_caching)
    tight = tight_llm.generate(batch, GREEDY)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight_llm.num_free_kv_blocks == tight_llm.num_kv_blocks == 9


def test_batches_respect_token_and_sequence_budgets(checkpoint):
    llm = make_llm(checkpoint, max_num_batched_tokens=16, max_num_seqs=3)
    scheduler = llm.engine.scheduler
    seen = []
    schedule = scheduler.schedule

    def recording_schedule(**kwargs):
        batch = schedule(**kwargs)
        seen.append([(s.request_id, s.num_computed_tokens, n, s.num_tokens)
                     for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)])
        return batch

    scheduler.schedule = recording_schedule
    llm.generate(prompts(seed=6), GREEDY)
    assert all(sum(n for _, _, n, _ in step) <= 16 for step in seen)
    assert all(len(step) <= 3 for step in seen)
    # Some prompt was split over steps (chunked prefill), and a chunk shared a step with
    # another request's decode token.
    assert any(done + n < total for step in seen for _, done, n, total in step)
    assert any(len({n > 1 for *_, n, _ in step}) == 2 for step in seen)
    assert llm.num_free_kv_blocks == llm.num_kv_blocks


def test_abort_frees_blocks_wherever_the_request_is(checkpoint):
    llm = make_llm(checkpoint, max_num_batched_tokens=8, max_num_seqs=2)
    ids = llm.submit(prompts(seed=8, lens=(30, 20, 25, 10)), GREEDY)
    decoding, prefilling, waiting, kept = ids
    finished = {}
    for step, out in enumerate(llm.run()):
        if out.finished:
            finished[out.request_id] = out.finish_reason
        if step == 0:
            # request 0 is past its prompt, 1 is mid-prefill, 2 and 3 wait for a seat.
            assert llm.engine.scheduler.find(prefilling).num_computed_tokens < 20
            assert llm.abort(decoding) and llm.abort(prefilling) and llm.abort(waiting)
            assert not llm.abort(decoding)  # already gone
    assert finished == {kept: "length"}
    assert llm.num_free_kv_blocks == llm.num_kv_blocks


def test_stream_yields_every_token_in_order(checkpoint):
    llm = make_llm(checkpoint)
    batch = prompts(seed=9, lens=(7, 19))
    expected = [o.token_ids for o in make_llm(checkpoint).generate(batch, GREEDY)]
    streamed: dict[str, list[int]] = {}
    for out in llm.stream(batch, GREEDY):
        tokens = streamed.setdefault(out.request_id, [])
        assert out.index == len(tokens)
        tokens.append(out.token_id)
        assert out.finished == (len(tokens) == GREEDY.max_tokens)
    assert list(streamed.values()) == expected
