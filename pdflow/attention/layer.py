"""The attention layer a model calls: store this step's K/V, then attend over the cache."""

from __future__ import annotations

import torch
from torch import nn

from pdflow.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """Holds no weights: a KV binding attaches this layer's caches and the backend."""

    def __init__(
        self, *, layer: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An fp8 cache's scale caches (kernels/kv_quant.py); None for a 16/32-bit cache.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.backend = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def forward(self, q, k, v, meta: AttentionMetadata, *, kv_stored: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H_q, D], k/v [T, H_kv, D] -> [T, H_q, D]. ``kv_stored``: the caller
        already wrote this step's K/V to the bound caches (the model's fused RoPE kernel).
        ``out``: a [T, H_q, D] tensor to write the result into (and return)."""
        if self.k_cache is None:
            raise RuntimeError(f"layer {self.layer} has no KV cache bound (KVCacheBinding.bind)")
        b = self.backend
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale} if self.quantized else {}
        if not kv_stored:
            b.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **scales)
        if meta.decode_only:
            res = b.decode_attention(
                q, self.k_cache, self.v_cache, meta.context_lens, meta.block_tables, self.scale,
                **scales,
            )
            return res if out is None else out.copy_(res)
        return b.prefill_attention(
            q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.context_lens,
            meta.block_tables, self.scale, max_seqlen_q=meta.max_seqlen_q, out=out, **scales,
        )
