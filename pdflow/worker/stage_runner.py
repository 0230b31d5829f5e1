"""Runs one StepInput through this process's model stage.

The same code serves a whole model in one process and one rank of a TP/PP instance:
tensors come from the plain message, the stage's tap layers are captured on the way, and
the last stage turns the sampled rows into tokens with per-request generators.
"""

from __future__ import annotations

import itertools

import torch

from pdflow.attention.metadata import AttentionMetadata
from pdflow.model.decoder import CausalLM
from pdflow.parallel.messages import StepInput, StepOutput
from pdflow.worker.logprobs import sampled_top
from pdflow.worker.sampler import Sampler, make_generator

# Steps whose every sequence brings at most this many new tokens run as decode rows,
ROWS_AS_DECODE = 16
# and so do steps of at most this many new tokens in all (a prefix-hit tail, a short
# prompt): the prefill grid gives such a step one or two query tiles per (sequence, KV
# head), each walking the whole context alone (4 ms a layer for a 28-token tail over
# 1.7K tokens of the fp32 tiny model on the H200), while decode rows split the context.
SHORT_STEP_ROWS = 128


def runs_as_decode_rows(q_lens: list[int], *, short_steps: bool = True) -> bool:
    """Whether a step with these new tokens per sequence runs as one decode row per token.
    ``short_steps`` False (the CPU): only verifies do. There the prefill op gathers each
    sequence's context once and attends with one SDPA, while decode rows each re-read it:
    a 64-token tail over 256 cached tokens of the tiny model took 0.56 ms a layer as a
    prefill and 0.96 ms as rows (one thread), the bulk of a decode instance's local
    prefill of a later chat turn (bench/RESULTS.md, issue 33)."""
    longest = max(q_lens, default=0)
    return longest > 1 and (longest <= ROWS_AS_DECODE or (short_steps and sum(q_lens) <= SHORT_STEP_ROWS))


class StageRunner:
    def __init__(self, model: CausalLM, device: torch.device, capture_layers: tuple[int, ...] = ()):
        self.model = model
        self.device = device
        self.short_steps = device.type != "cpu"  # short chunks as decode rows (runs_as_decode_rows)
        self.capture_layers = tuple(capture_layers)
        self.sampler = Sampler()
        # Seeded requests' generators live where sampling happens, keyed by request id.
        self.generators: dict[str, torch.Generator] = {}

    def _tensor(self, values, dtype) -> torch.Tensor:
        """On CUDA through pinned memory: the copy is queued without waiting for the device
        (under overlap scheduling the host builds this step while the last one runs)."""
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        t = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def tensors(
        self, step: StepInput, samples: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's device tensors. ``samples``: the tokens step ``placeholder_step``
        sampled (overlap scheduling), gathered into the placeholder rows on the device."""
        q_lens = [b - a for a, b in itertools.pairwise(step.cu_seqlens_q)]
        longest = max(q_lens, default=0)
        if runs_as_decode_rows(q_lens, short_steps=self.short_steps):
            meta = self._rows_as_decode(step, q_lens)
        else:
            meta = AttentionMetadata(
                decode_only=longest == 1,
                slot_mapping=self._tensor(step.slot_mapping, torch.int64),
                cu_seqlens_q=self._tensor(step.cu_seqlens_q, torch.int32),
                context_lens=self._tensor(step.context_lens, torch.int32),
                block_tables=self._tensor(step.block_tables, torch.int32),
                max_seqlen_q=longest,
            )
        ids = self._tensor(step.token_ids, torch.int64)
        if step.placeholder_rows:
            if samples is None:
                raise RuntimeError(f"step {step.step} reads step {step.placeholder_step}'s samples, "
                                   "which this rank does not hold")
            rows = self._tensor(step.placeholder_rows, torch.int64)
            ids.index_copy_(0, rows, samples.index_select(0, self._tensor(step.placeholder_samples, torch.int64)))
        return ids, self._tensor(step.positions, torch.int64), meta

    def _rows_as_decode(self, step: StepInput, q_lens: list[int]) -> AttentionMetadata:
        """A step of short queries (a verify of [anchor, k drafts], a short chunk) as one
        decode row per new token: row i of a sequence attends to its own causal prefix of
        the same blocks (context ``start + i + 1``). Exact causal attention, served by the
        decode kernel (split over the context; and a captured decode graph when the rows
        fit one) instead of a prefill tile sized for long chunks."""
        rows = sum(q_lens)
        lens, owner = [], []
        for seq, (n, ctx) in enumerate(zip(q_lens, step.context_lens, strict=True)):
            lens += range(ctx - n + 1, ctx + 1)
            owner += [seq] * n
        tables = self._tensor(step.block_tables, torch.int32)
        return AttentionMetadata(
            decode_only=True,
            slot_mapping=self._tensor(step.slot_mapping, torch.int64),
            cu_seqlens_q=self._tensor(list(range(rows + 1)), torch.int32),
            context_lens=self._tensor(lens, torch.int32),
            block_tables=tables.index_select(0, self._tensor(owner, torch.int64)),
            max_seqlen_q=1,
            sequence_block_tables=tables,
        )

    def forward(
        self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        taps_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states out of this stage, and the taps relayed so far (earlier stages'
        then this stage's, in tap order), or None when there are none."""
        hidden, captured = self.model.forward_with_taps(inputs, positions, meta, self.capture_layers)
        parts = ([taps_in] if taps_in is not None else []) + captured
        return hidden, (torch.cat(parts, dim=-1) if parts else None)

    def logits(self, step: StepInput, hidden: torch.Tensor) -> torch.Tensor | None:
        if not step.sample_rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(step.sample_rows, torch.int64)])

    def output(self, step: StepInput, logits: torch.Tensor | None) -> StepOutput:
        """The step's answer to the owner: sampled tokens and their logprobs (and their
        top logprobs, for the rows that asked)."""
        tokens, logprobs = self.sample(step, logits)
        out = StepOutput(step=step.step, token_ids=tokens, logprobs=logprobs)
        if step.top_logprobs and logits is not None:
            out.top_logprobs = sampled_top(step, logits)
        return out

    def sample(self, step: StepInput, logits: torch.Tensor | None) -> tuple[list[int], list[float]]:
        if logits is None:
            self._generators(step)
            return [], []
        return self.sampler(logits, step.sampling, self._generators(step))

    def sample_on_device(self, step: StepInput, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and logprobs of the sampled rows, left on the device."""
        return self.sampler.on_device(logits, step.sampling, self._generators(step))

    def _generators(self, step: StepInput) -> list[torch.Generator | None]:
        """Each sampled row's generator (seeded requests keep theirs across steps)."""
        for rid in step.released_seq_ids:
            self.generators.pop(rid, None)
        generators = []
        for rid, params in zip(step.sample_seq_ids, step.sampling, strict=True):
            if params.seed is not None and rid not in self.generators:
                self.generators[rid] = make_generator(params.seed, self.device)
            generators.append(self.generators.get(rid))
        return generators
