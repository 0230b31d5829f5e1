"""Prefix caching in the block pool: chained hashes, verified hits, ref counts, eviction."""

from __future__ import annotations

import pdflow.engine.block_manager as bm_module
from pdflow.engine.block_manager import BlockManager
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    sampling=SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Allocate and 'compute' the whole sequence, as a finished prefill leaves it."""
    assert bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return s


def test_shared_prefix_hits_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = computed(bm, seq(list(range(10)), "a"))  # blocks: [0-3] [4-7] [8,9]
    b = seq(list(range(8)) + [50, 51, 52], "b")
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert bm.num_free_blocks == 8 - 2  # the shared two are still b's
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_a_differing_earlier_block_breaks_the_chain():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    computed(bm, seq(list(range(9)), "a"))
    # Same second block, different first block: chained hashes must not hit block 2.
    assert bm.match_prefix(seq([9, 9, 9, 9, 4, 5, 6, 7, 1], "b")) == 0


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    computed(bm, seq(list(range(8)), "a"))
    # An identical 8-token prompt reuses only its first block: the logits of token 8
    # need its K/V recomputed in a block of its own.
    assert bm.match_prefix(seq(list(range(8)), "b")) == 4


def test_hash_collisions_are_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    computed(bm, seq([1, 2, 3, 4, 5], "a"))
    assert bm.match_prefix(seq([7, 7, 7, 7, 5], "b")) == 0
    assert bm.match_prefix(seq([1, 2, 3, 4, 6], "c")) == 4


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = computed(bm, seq(list(range(9)), "a"))
    bm.free(a)
    assert bm.num_free_blocks == 3
    hit = seq(list(range(8)) + [99], "b")
    assert bm.match_prefix(hit) == 8
    bm.free(hit)
    # A stranger takes the whole pool: the cached blocks are overwritten and forgotten.
    stranger = computed(bm, seq([100 + i for i in range(12)], "c"))
    bm.free(stranger)
    assert bm.match_prefix(seq(list(range(8)) + [99], "d")) == 0


def test_empty_blocks_go_before_any_cached_prefix_is_evicted():
    """Freed in this order: a's partial tail, a's two cached blocks, b's partial block. A
    two-block request takes the two empty ones; the least recently freed pair would have
    been a's tail and a's second block, cutting a's cached prefix in half."""
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = computed(bm, seq(list(range(9)), "a"))  # blocks 0, 1 full (cached), 2 partial
    b = computed(bm, seq([70, 71, 72], "b"))  # block 3, partial
    bm.free(a)
    bm.free(b)
    c = computed(bm, seq([80 + i for i in range(6)], "c"))
    assert sorted(c.block_table) == [2, 3]
    bm.free(c)
    assert bm.match_prefix(seq(list(range(8)) + [99], "d")) == 8


def test_allocation_fails_without_side_effects_when_short():
    bm = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    s = seq(list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(s, 8) and bm.usage == 1.0


def test_peek_prefix_sources_counts_what_match_prefix_would_take_and_takes_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = computed(bm, seq(list(range(10)), "a"))
    bm.free(a)
    prompt = list(range(8)) + [50, 51, 52]
    before = (bm.num_free_blocks, bm.hit_tokens, [b.ref_count for b in bm.blocks])
    assert bm.peek_prefix_sources(prompt) == (8, 0)
    assert (bm.num_free_blocks, bm.hit_tokens, [b.ref_count for b in bm.blocks]) == before
    assert bm.match_prefix(seq(prompt, "b")) == 8
    assert bm.peek_prefix_sources(list(range(8)))[0] == 4  # the last token is never served from cache
    off = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    assert off.peek_prefix_sources(prompt) == (0, 0)


def test_producer_held_blocks_are_a_leading_run_and_forgotten_on_eviction():
    """A remote prefill's prompt blocks are marked (the producer computed them); blocks
    this instance computed after them are not, so ``peek_prefix_sources`` reports the
    cached run and its leading marked part. An evicted block loses the mark."""
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)
    remote = computed(bm, seq(list(range(9)), "remote"))  # 2 full blocks, as a remote prefill lands
    bm.mark_producer_held(remote)
    bm.free(remote)
    local = seq(list(range(16)) + [99], "local")  # blocks 0-1 from the cache, 2-3 computed here
    bm.match_prefix(local)
    computed(bm, local)
    bm.free(local)
    assert bm.peek_prefix_sources(list(range(16)) + [7]) == (16, 8)
    assert bm.peek_prefix_sources(list(range(8)) + [7]) == (8, 8)
    stranger = computed(bm, seq([100 + i for i in range(20)], "stranger"))  # the whole pool
    bm.free(stranger)
    again = computed(bm, seq(list(range(9)), "again"))  # the same tokens, computed here this time
    bm.free(again)
    assert bm.peek_prefix_sources(list(range(8)) + [7]) == (8, 0)
