"""A last-stage rank's part of speculative decoding, run after every target forward.

Every TP rank of the last stage runs it in lockstep (the drafter's layers and the
embedding all-reduce over the stage's TP group), so each computes the same tokens: greedy
rows are deterministic, sampled rows draw from per-request generators seeded alike on
every rank (unseeded rows: one stream per step from the run's seed). The order is
``spec_decode.drafter``'s contract: write the step's context K/V, verify (or sample when
a row offered no drafts), commit, then propose from the emitted token. What a producer
does differs only by ``DraftDuties``: a dspark producer never proposes; an eagle producer
proposes one draft (which writes the final context entry) and drops it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdflow.attention.metadata import AttentionMetadata
from pdflow.parallel.messages import StepInput, TopLogprobs
from pdflow.spec_decode import (
    ContextBatch,
    DraftDuties,
    Drafter,
    ProposeBatch,
    SamplingBatch,
    padded_rows,
    verify,
)
from pdflow.worker.logprobs import sampled_top
from pdflow.worker.sampler import make_generator

# Unseeded rows draw from a stream per step: seed * STREAM + step (the same on every rank).
STREAM = 1_000_003


@dataclass(kw_only=True, slots=True)
class DraftedStep:
    """Per sampled sequence: the tokens it emitted (accepted drafts + one), their
    logprobs, and its drafts for the next step (empty when this side keeps none)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    drafts: list[list[int]]
    # StepInput.top_logprobs: per emitted token, flat (empty when no row asked).
    top: list[TopLogprobs] = field(default_factory=list)


class Drafting:
    def __init__(self, drafter: Drafter, duties: DraftDuties, *, num_drafts: int, seed: int,
                 device: torch.device):
        self.drafter, self.duties = drafter, duties
        # A producer proposes only to write the last context entry: one draft does it.
        self.num_drafts = num_drafts if duties.keep_drafts else 1
        self.seed, self.device = seed, device
        self.generators: dict[str, torch.Generator] = {}
        # Per request: the drafts proposed last and what they were drawn from (None: argmax).
        self.proposed: dict[str, tuple[list[int], torch.Tensor | None]] = {}

    def step(self, msg: StepInput, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             hidden: torch.Tensor, taps: torch.Tensor | None, compute_logits) -> DraftedStep:
        drafter = self.drafter
        self._release(msg.released_seq_ids)
        for sid, entries in zip(msg.seq_ids, msg.context_adopt, strict=True):
            if entries >= 0:  # first forward since admission: the pool holds [0, entries)
                drafter.rollback([sid], [0])
                drafter.adopt(sid, entries)
        features = taps if drafter.tap_layers else hidden
        cu = msg.cu_seqlens_q
        starts = [msg.positions[c] for c in cu[:-1]]
        drafter.write_context_kv(ContextBatch(
            seq_ids=msg.seq_ids, cu_seqlens=cu, start_positions=starts, features=features,
            positions=positions, slot_mapping=meta.slot_mapping, token_ids=ids,
            next_token_ids=msg.next_token_ids,
        ))
        sampling, default = self._sampling(msg)
        out = self._verify(msg, ids, hidden, compute_logits, sampling, default)
        index = {sid: i for i, sid in enumerate(msg.seq_ids)}
        committed = [starts[i] + cu[i + 1] - cu[i] for i in range(len(msg.seq_ids))]
        for sid, drafts, emitted in zip(msg.sample_seq_ids, _drafts_of(msg), out.tokens, strict=True):
            committed[index[sid]] += len(emitted) - 1 - drafts  # rows past the accepted ones drop
        drafter.commit(msg.seq_ids, committed)
        if self.duties.propose and msg.sample_seq_ids:
            rows = [index[sid] for sid in msg.sample_seq_ids]
            anchors = [committed[i] for i in rows]
            # The feature of the row that sampled the anchor (chain drafters start there).
            feature_rows = [cu[i] + p - 1 - starts[i] for i, p in zip(rows, anchors, strict=True)]
            self._propose(msg, out, anchors, rows, meta.block_tables_by_sequence(), features[self._index(feature_rows)],
                          sampling, default)
        return out

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _sampling(self, msg: StepInput) -> tuple[SamplingBatch | None, torch.Generator | None]:
        if all(p.greedy for p in msg.sampling):
            return None, None  # nothing is drawn: no generator to build
        default = make_generator(self.seed * STREAM + msg.step, self.device)
        gens = []
        for sid, p in zip(msg.sample_seq_ids, msg.sampling, strict=True):
            if p.seed is not None and sid not in self.generators:
                self.generators[sid] = make_generator(p.seed, self.device)
            gens.append(self.generators.get(sid))
        return SamplingBatch.from_lists(
            [p.temperature for p in msg.sampling], [p.top_k for p in msg.sampling],
            [p.top_p for p in msg.sampling], gens, device=self.device,
        ), default

    def _verify(self, msg: StepInput, ids: torch.Tensor, hidden: torch.Tensor, compute_logits,
                sampling: SamplingBatch | None, default: torch.Generator | None) -> DraftedStep:
        if not msg.sample_seq_ids:
            return DraftedStep(tokens=[], logprobs=[], drafts=[])
        counts = _drafts_of(msg)
        rows = [r for last, n in zip(msg.sample_rows, counts, strict=True) for r in range(last - n, last + 1)]
        logits = padded_rows(compute_logits(hidden[self._index(rows)]), self._index(counts))
        width = logits.shape[1] - 1
        drafts = torch.full((len(counts), width), -1, dtype=torch.int64, device=self.device)
        for b, (last, n) in enumerate(zip(msg.sample_rows, counts, strict=True)):
            if n:
                drafts[b, :n] = ids[last - n + 1:last + 1]
        q = self._draft_probs(msg, counts, drafts, logits.shape[-1]) if sampling is not None else None
        result = verify(logits, drafts, num_drafts=self._index(counts), sampling=sampling,
                        draft_probs=q, generator=default)
        tokens = result.emitted()
        lps = [row[:len(t)] for row, t in zip(result.logprobs.tolist(), tokens, strict=True)]
        top = []
        if msg.top_logprobs:  # emitted token j of sequence b was scored by logits[b, j]
            emitted = torch.cat([logits[b, :len(t)] for b, t in enumerate(tokens)])
            top = sampled_top(msg, emitted, [len(t) for t in tokens])
        return DraftedStep(tokens=tokens, logprobs=lps, drafts=[], top=top)

    def _draft_probs(self, msg: StepInput, counts: list[int], drafts: torch.Tensor, vocab: int) -> torch.Tensor:
        """[B, K, V]: what each offered draft was drawn from (one-hot where it was an argmax)."""
        q = torch.nn.functional.one_hot(drafts.clamp(min=0), vocab).to(torch.float32)
        for b, (sid, n) in enumerate(zip(msg.sample_seq_ids, counts, strict=True)):
            if not n:
                continue
            tokens, probs = self.proposed.get(sid, ([], None))
            if tokens[:n] != drafts[b, :n].tolist():
                raise RuntimeError(f"request {sid!r}: the owner sent drafts {drafts[b, :n].tolist()} but this "
                                   f"rank proposed {tokens[:n]}; drafts must come from the last proposal")
            if probs is not None:
                q[b, :n] = probs[:n]
        return q

    def _propose(self, msg: StepInput, out: DraftedStep, anchors: list[int], rows: list[int],
                 block_tables: torch.Tensor, anchor_features: torch.Tensor, sampling: SamplingBatch | None,
                 default: torch.Generator | None) -> None:
        proposal = self.drafter.propose(ProposeBatch(
            seq_ids=list(msg.sample_seq_ids),
            anchor_ids=torch.tensor([t[-1] for t in out.tokens], dtype=torch.int64, device=self.device),
            anchor_positions=anchors, block_tables=block_tables[self._index(rows)],
            num_drafts=self.num_drafts, anchor_features=anchor_features, sampling=sampling, generator=default,
        ))
        if not self.duties.keep_drafts:
            out.drafts = [[] for _ in anchors]
            return
        out.drafts = proposal.tokens.tolist()
        for b, sid in enumerate(msg.sample_seq_ids):
            self.proposed[sid] = (out.drafts[b], None if proposal.probs is None else proposal.probs[b])

    def begin_graphed(self, msg: StepInput, starts: list[int]) -> None:
        """Before a captured drafted step (``drafted_graphs``) writes the step's context
        entries: the host part of ``step`` up to the write (releases, the ledger's record,
        which refuses a gap before anything is written)."""
        self._release(msg.released_seq_ids)
        self.drafter.record_context_write(msg.seq_ids, msg.cu_seqlens_q, starts, msg.next_token_ids)

    def finish_graphed(self, msg: StepInput, starts: list[int], emitted: list[list[int]],
                       logprobs: list[list[float]], drafts: list[list[int]]) -> DraftedStep:
        """After a captured drafted step: the host part of ``step`` past verification
        (commit, the proposal's ledger check, the drafts kept for the next step)."""
        committed = [start + len(run) for start, run in zip(starts, emitted, strict=True)]
        self.drafter.commit(msg.seq_ids, committed)
        self.drafter.require_context(msg.seq_ids, committed)
        for sid, run in zip(msg.seq_ids, drafts, strict=True):
            self.proposed[sid] = (run, None)
        return DraftedStep(tokens=emitted, logprobs=logprobs, drafts=drafts)

    def release(self, seq_ids: list[str]) -> None:
        """Forget these requests (the warm-up's, once its steps ran)."""
        self._release(seq_ids)

    def _release(self, seq_ids: list[str]) -> None:
        self.drafter.release(seq_ids)
        for sid in seq_ids:
            self.generators.pop(sid, None)
            self.proposed.pop(sid, None)


def _drafts_of(msg: StepInput) -> list[int]:
    return list(msg.num_drafts) if msg.num_drafts else [0] * len(msg.sample_seq_ids)
