"""What one forward pass tells every attention layer about the batch's paged context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class AttentionMetadata:
    """Tensors the attention ops take (see ``pdflow.kernels.reference``).

    ``decode_only``: every sequence brings exactly one new token, so the decode op runs;
    otherwise the prefill op serves the whole (possibly mixed) batch.

    Build new tensors for every step and never change them in place: every layer of a
    step gets the same tensors, and the ``torch`` backend derives its gather indices and
    masks once per step, keyed on their identity (see ``attention.paged_plan``).
    """

    decode_only: bool
    # [N] int64: cache slot of each new token (block_id * block_size + offset), -1 skips.
    slot_mapping: torch.Tensor
    # [B+1] int32: offsets of each sequence's new tokens in the flattened batch.
    cu_seqlens_q: torch.Tensor
    # [B] int32: KV tokens per sequence including this step's new ones.
    context_lens: torch.Tensor
    # [B, max_blocks] int32: block ids of each sequence, padded with 0.
    block_tables: torch.Tensor
    # Longest chunk of new tokens, known on the host when the step is built: prefill
    # kernels size their grid from it instead of reading cu_seqlens_q back every layer.
    max_seqlen_q: int | None = None
    # [B, max_blocks] int32: each *sequence's* block ids, for callers other than attention
    # (the drafter). Differs from ``block_tables`` when a short-query step runs as one
    # decode row per token; None means ``block_tables``.
    sequence_block_tables: torch.Tensor | None = None

    def block_tables_by_sequence(self) -> torch.Tensor:
        return self.block_tables if self.sequence_block_tables is None else self.sequence_block_tables
