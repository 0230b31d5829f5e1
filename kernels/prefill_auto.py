"""The prefill op the ``triton`` backend calls: the best measured kernel where it
applies, the pointer kernel everywhere else.

Round 4 measured the TMA variant (``tma2d`` with ``loop_stages=3``, the 128-row tile run
as two 64-row halves over 64-token K/V tiles, 4 warps) 17% faster than the pointer kernel
at page 16 and 128 on the H200 (0.776-0.778x vs 0.66x SDPA at 8K; round 2's setting was
0.736x in the same run).
It needs TMA (Hopper or newer, a triton with tensor descriptors), a K/V tile that is
one box (block size a multiple of the 128-token tile, contiguous caches, power-of-two
head_dim) and 16-bit data (the measured case; fp32 tiles would double shared memory).
The CPU interpreter always takes the pointer kernel, so CI keeps testing it.
"""

from __future__ import annotations

import functools

import torch

from ._common import interpreting
from .prefill_attention import prefill_attention as prefill_attention_ptr
from .prefill_variants import prefill_attention_variant, tma_supported, variant_kv_mode

__all__ = ["BEST", "prefill_attention", "uses_tma"]

BEST = dict(kv="tma2d", loop_stages=3, block_m=128, block_n=64, num_warps=4, split=2)


@functools.lru_cache(maxsize=16)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def uses_tma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when ``prefill_attention`` would run the TMA kernel for these tensors."""
    if interpreting(q) or not tma_supported() or not _has_tma(q.device):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and 16 <= q.shape[-1] <= 128
            and v_cache.is_contiguous() and k_cache.data_ptr() % 16 == 0
            and v_cache.data_ptr() % 16 == 0
            and variant_kv_mode(k_cache, "tma2d", BEST["block_n"]) != "ptr")


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                      *, max_seqlen_q=None, out=None):
    """Same contract as ``prefill_attention.prefill_attention`` (default tiles)."""
    if uses_tma(q, k_cache, v_cache):
        return prefill_attention_variant(q, k_cache, v_cache, cu_seqlens_q, context_lens,
                                         block_tables, scale, max_seqlen_q=max_seqlen_q,
                                         out=out, **BEST)
    return prefill_attention_ptr(q, k_cache, v_cache, cu_seqlens_q, context_lens,
                                 block_tables, scale, max_seqlen_q=max_seqlen_q, out=out)
