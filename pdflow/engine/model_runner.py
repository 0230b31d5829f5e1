"""Turns a scheduled batch into the model's input tensors, runs it, samples."""

from __future__ import annotations

import torch

from pdflow.attention.metadata import AttentionMetadata
from pdflow.engine.sampler import Sampler, make_generator
from pdflow.engine.scheduler import ScheduledBatch
from pdflow.engine.sequence import Sequence
from pdflow.model.decoder import CausalLM


class ModelRunner:
    """One device, one full model (TP1/PP1). A sequence is sampled when this step
    computes its last known token."""

    def __init__(self, model: CausalLM, *, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    def _tensor(self, values, dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def prepare(self, batch: ScheduledBatch):
        """Flattened ids/positions, the attention metadata, the sequences to sample and
        their rows in the flattened batch."""
        bs = self.block_size
        ids, positions, slots, cu, ctx = [], [], [], [0], []
        sampled, sample_rows = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + n)
            ctx.append(end)
            if end == seq.num_tokens:
                sampled.append(seq)
                sample_rows.append(cu[-1] - 1)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        meta = AttentionMetadata(
            decode_only=cu[-1] == len(batch.seqs),
            slot_mapping=self._tensor(slots, torch.int64),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            context_lens=self._tensor(ctx, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
        )
        inputs = (self._tensor(ids, torch.int64), self._tensor(positions, torch.int64))
        return inputs, meta, sampled, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Run one step; returns the sampled sequences with their token and its logprob."""
        (ids, positions), meta, sampled, rows = self.prepare(batch)
        hidden = self.model(ids, positions, meta)
        if not sampled:
            return [], [], []
        logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)])
        for seq in sampled:
            if seq.generator is None and seq.sampling.seed is not None:
                seq.generator = make_generator(seq.sampling.seed, self.device)
        tokens, logprobs = self.sampler(
            logits, [s.sampling for s in sampled], [s.generator for s in sampled]
        )
        return sampled, tokens, logprobs
