"""KV block pool with prefix caching.

Every full block of computed tokens gets a chained hash (its tokens plus the hash of the
block before), so a hit means the whole prefix up to it matches. Hits are verified by
comparing token ids, so a hash collision costs a miss, never wrong K/V. Blocks are
reference counted; a freed block keeps its hash and stays reusable until the pool hands
it out again. The pool hands out empty blocks first (never filled, a partial tail, an
evicted one) and evicts a cached one, least recently freed first, only when none is left:
one LRU queue of both let a round of requests evict the prefixes its later requests were
about to hit while empty blocks sat behind them (multi-turn traffic, bench/RESULTS.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdflow.engine.sequence import Sequence

NO_HASH = None


@dataclass(kw_only=True, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = NO_HASH
    token_ids: tuple[int, ...] = ()
    # P/D consumer: a producer computed these tokens too (they were in a remote prefill's
    # prompt), so its prefix cache likely holds them; blocks this instance computed
    # itself (a local prefill, its generated tokens) a producer never saw.
    producer_held: bool = False


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        # Free blocks holding no cached prefix, and those that do (findable by hash), each
        # in the order they were freed.
        self.free_empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}
        # Prompt tokens served from the prefix cache so far (reported, tested).
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_empty) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest matching run of full prompt blocks and
        return the tokens they hold. The last token is never served from cache: its
        logits must be computed."""
        if seq.block_table or seq.sampling.prompt_logprobs is not None:  # every position computed
            return 0
        for block_id, h in self._cached_run(seq.token_ids):
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def peek_prefix_sources(self, token_ids: list[int]) -> tuple[int, int]:
        """Taking nothing: the tokens ``match_prefix`` would serve from cache for this
        prompt, and those of them a producer also computed (the run's leading
        producer-held blocks). P/D: whether to prefill locally; the second is a guess at
        what a remote prefill would not recompute (the producer may have evicted them)."""
        run = self._cached_run(token_ids)
        held = next((i for i, (block_id, _) in enumerate(run) if not self.blocks[block_id].producer_held), len(run))
        return len(run) * self.block_size, held * self.block_size

    def mark_producer_held(self, seq: Sequence) -> None:
        """A remote prefill of ``seq`` landed: its producer computed the whole prompt, so
        every full prompt block (the cached copy, where a twin holds the hash) is one
        the producer's prefix cache can serve."""
        for h in seq.block_hashes[: seq.num_prompt_tokens // self.block_size]:
            if (block_id := self.cached.get(h)) is not None:
                self.blocks[block_id].producer_held = True

    def _cached_run(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(block id, hash) of the cached blocks that hold the prompt's leading full blocks,
        the last token left out."""
        if not self.enable_prefix_caching:
            return []
        bs, parent, run = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            run.append((block_id, h))
            parent = h
        return run

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens; False (and no change)
        when the pool is short."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id = next(iter(self.free_empty or self.free_cached))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks that became full of computed tokens, so later prompts hit them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached:  # a twin computed concurrently keeps the first copy
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; the last block goes back first so the prefix
        blocks, shared more often, survive longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                holds_prefix = block.hash is not NO_HASH and self.cached.get(block.hash) == block_id
                (self.free_cached if holds_prefix else self.free_empty)[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_empty.pop(block_id, None)
            self.free_cached.pop(block_id, None)
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not NO_HASH and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.producer_held = NO_HASH, (), False
