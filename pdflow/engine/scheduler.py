"""Continuous batching with chunked prefill under a token budget, preempting by recompute.

Each step spends at most ``max_num_batched_tokens`` new tokens: running sequences first
(one token each when decoding, the next chunk when still prefilling), then waiting ones
in arrival order while ``max_num_seqs`` allows. When blocks run out, the most recently
admitted running sequence gives its blocks back and waits to be recomputed.

With pipeline parallelism several steps are in flight at once: a sequence in a step not
yet collected is skipped (and never preempted: its K/V is still being written), and
``schedule(max_seqs=...)`` caps a step's sequences so the running ones spread over the
steps in flight instead of all landing in the first.

With overlap scheduling (one rank, one step in flight while the next is built), a
sequence whose step in flight samples it decodes again at once: its input is that
step's sample, still on the device (a placeholder the rank fills in). Its position,
slot and blocks do not depend on the token's value; a step that would emit past
``max_tokens`` or ``max_model_len`` is not scheduled. A sequence that finishes while a
step still writes into its blocks keeps them until that step is back.
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
    # Overlap scheduling: the sequence decodes the token its step in flight samples.
    ahead: list[bool]

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 lookahead: int = 0, max_model_len: int | None = None, overlap: bool = False):
        self.blocks = blocks
        self.overlap = overlap
        # Speculative decoding: positions a sampled sequence's next drafts occupy.
        self.lookahead = lookahead
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # P/D: sequences whose blocks a KV transfer holds, never scheduled (their status
        # says which way: WAITING_FOR_REMOTE_KV on a consumer, SENDING_KV on a producer).
        self.transfers: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return self.transfers.get(request_id)

    def park(self, seq: Sequence, status: SequenceStatus) -> None:
        """Hold ``seq`` and its blocks for a KV transfer (out of running, never scheduled)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = status
        self.transfers[seq.request_id] = seq

    def unpark(self, request_id: str, status: SequenceStatus) -> Sequence | None:
        """The sequence a transfer held, if it is in ``status``; the caller decides its fate."""
        seq = self.transfers.get(request_id)
        if seq is None or seq.status is not status:
            return None
        return self.transfers.pop(request_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is and give its blocks back, or, while a step in
        flight still writes into them, leave that to whoever collects the step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.in_flight:
            self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def runs_ahead(self, seq: Sequence) -> bool:
        """Overlap scheduling: ``seq``'s step in flight samples its next token, and a step
        after it could still emit (under max_tokens and max_model_len)."""
        return (self.overlap and seq.in_flight and seq.sampled_at == seq.last_step
                and seq.num_output_tokens + 1 < seq.sampling.max_tokens
                and seq.num_tokens + 1 < self.max_model_len)

    def schedule(self, max_seqs: int | None = None) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        room = self.max_num_seqs if max_seqs is None else max_seqs
        batch = ScheduledBatch(seqs=[], num_new_tokens=[], num_drafts=[], ahead=[])
        preempted = False
        for seq in list(self.running):
            if budget == 0 or len(batch.seqs) >= room:
                break
            ahead = self.runs_ahead(seq)
            if seq.status is not SequenceStatus.RUNNING or (seq.in_flight and not ahead):
                continue  # preempted earlier in this loop, or its last step is not back
            if ahead:  # one row: the token its step in flight samples
                n, drafts, reserve = 1, 0, seq.num_tokens + 1
            else:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                drafts = drafts_to_score(seq, budget, self.max_model_len)
                n += drafts
                reserve = tokens_to_reserve(seq, n, drafts, self.lookahead)
            fits, evicted = self._make_room(seq, reserve)
            preempted = preempted or evicted
            if fits:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                batch.num_drafts.append(drafts)
                batch.ahead.append(ahead)
                budget -= n
        if not preempted:
            self._admit(batch, budget, room)
        return batch

    def _make_room(self, seq: Sequence, tokens: int) -> tuple[bool, bool]:
        """Blocks for ``seq``'s first ``tokens`` tokens, preempting the newest sequences
        whose step is back (``seq`` itself at worst). (allocated, preempted any)."""
        preempted = False
        while not self.blocks.allocate(seq, tokens):
            victim = next((v for v in reversed(self.running) if not v.in_flight), None)
            if victim is None:  # everyone else's step is in flight, and so is seq's
                return False, preempted
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, preempted
        return True, preempted

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
            batch.ahead.append(False)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its K/V (kept findable by the prefix cache)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.draft_ids = []  # recomputed from its tokens; the drafter proposes afresh
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
