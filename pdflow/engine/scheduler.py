"""Continuous batching with chunked prefill under a token budget, preempting by recompute.

Each step spends at most ``max_num_batched_tokens`` new tokens: running sequences first
(one token each when decoding, the next chunk when still prefilling), then waiting ones
in arrival order while ``max_num_seqs`` allows. When blocks run out, the most recently
admitted running sequence gives its blocks back and waits to be recomputed.

With pipeline parallelism several steps are in flight at once: a sequence in a step not
yet collected is skipped (and never preempted: its K/V is still being written), and
``schedule(max_seqs=...)`` caps a step's sequences so the running ones spread over the
steps in flight instead of all landing in the first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdflow.engine.block_manager import BlockManager
from pdflow.engine.sequence import Sequence, SequenceStatus
from pdflow.engine.spec_scheduler import drafts_to_score, tokens_to_reserve


@dataclass(kw_only=True, slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    # New tokens each sequence computes this step (same order as seqs), drafts included.
    num_new_tokens: list[int]
    # Of those, drafts at the tail (speculative decoding; 0 otherwise).
    num_drafts: list[int]

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 lookahead: int = 0, max_model_len: int | None = None):
        self.blocks = blocks
        # Speculative decoding: positions a sampled sequence's next drafts occupy.
        self.lookahead = lookahead
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def schedule(self, max_seqs: int | None = None) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        room = self.max_num_seqs if max_seqs is None else max_seqs
        batch = ScheduledBatch(seqs=[], num_new_tokens=[], num_drafts=[])
        preempted = False
        for seq in list(self.running):
            if budget == 0 or len(batch.seqs) >= room:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.in_flight:
                continue  # preempted earlier in this loop, or its last step is not back
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = drafts_to_score(seq, budget, self.max_model_len)
            n += drafts
            while not self.blocks.allocate(seq, tokens_to_reserve(seq, n, drafts, self.lookahead)):
                # The newest sequence whose step is back; ``seq`` itself at worst.
                victim = next(v for v in reversed(self.running) if not v.in_flight)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                batch.num_drafts.append(drafts)
                budget -= n
        if not preempted:
            self._admit(batch, budget, room)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int, room: int) -> None:
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(batch.seqs) < room):
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.allocate(seq, tokens_to_reserve(seq, n, 0, self.lookahead)):
                self.blocks.free(seq)
                break
            if seq.num_preemptions == 0 and seq.num_output_tokens == 0:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.fresh = True
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.num_drafts.append(0)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its K/V (kept findable by the prefix cache)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.draft_ids = []  # recomputed from its tokens; the drafter proposes afresh
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
