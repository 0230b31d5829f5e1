"""The prefill op the ``triton`` backend calls: the fastest measured kernel that applies.

1. ``gluon``: FlashAttention-3's schedule written in Gluon (kernels/prefill_gluon.py):
   1.02-1.04x SDPA at 8K tokens on the H200 (bench/KERNEL_NOTES.md). Needs Hopper, bf16,
   head_dim 64/128 and blocks a multiple of its 128-token tile (pages of 16-64 tokens
   load as one TMA box each).
2. ``tma``: the plain-Triton kernel with TMA tile loads (kernels/prefill_tma.py; 0.78x
   SDPA). Needs TMA (Hopper or newer, a triton with tensor descriptors), blocks a
   multiple of its 64-token tile, contiguous caches, 16-bit data, power-of-two
   head_dim <= 128.
3. ``pointer``: the pointer-load kernel everywhere else, the CPU interpreter included,
   so CI keeps testing it.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ._common import interpreting
from .prefill_attention import prefill_attention as prefill_attention_ptr
from .prefill_gluon import D64_LONG, gluon_applies, prefill_attention_gluon
from .prefill_tma import prefill_attention_tma, tma_kv_mode, tma_supported

__all__ = ["kernel_for", "length_breaks", "prefill_attention", "uses_tma"]


@functools.lru_cache(maxsize=16)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def uses_tma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when the TMA kernel can run these tensors."""
    if interpreting(q) or not tma_supported() or not _has_tma(q.device):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and 16 <= q.shape[-1] <= 128
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0
            and tma_kv_mode(k_cache, v_cache) != 0)


def length_breaks(head_dim: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Lengths of a step's longest prompt (``max_seqlen_q``) from which the kernel this op
    runs over a ``dtype`` cache of ``head_dim`` is another compile: a warm-up meets a prompt
    on each side of each break. Only the Gluon kernel has one (bf16, ``gluon_applies``):
    three warpgroups from ``D64_LONG`` tokens at head dim 64. Other caches (fp32, fp16, fp8
    and its scale units) run a kernel of one compile at every length."""
    return (D64_LONG,) if head_dim == 64 and dtype == torch.bfloat16 else ()


_GLUON_BROKEN: set[str] = set()  # devices where the Gluon kernel failed to build or run


def kernel_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """Which kernel ``prefill_attention`` runs for these tensors: gluon, tma or pointer."""
    if str(q.device) not in _GLUON_BROKEN and gluon_applies(q, k_cache, v_cache):
        return "gluon"
    return "tma" if uses_tma(q, k_cache, v_cache) else "pointer"


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                      *, max_seqlen_q=None, out=None, k_scale=None, v_scale=None):
    """Same contract as ``prefill_attention.prefill_attention``. An fp8 cache (with its
    scales) runs the pointer kernel, the one that dequantizes as it loads."""
    args = (q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
    if k_scale is not None:
        return prefill_attention_ptr(*args, max_seqlen_q=max_seqlen_q, out=out, k_scale=k_scale,
                                     v_scale=v_scale)
    kernel = kernel_for(q, k_cache, v_cache)
    if kernel == "gluon":
        try:
            return prefill_attention_gluon(*args, max_seqlen_q=max_seqlen_q, out=out, checked=True)
        except Exception as exc:  # Gluon is experimental: a triton that cannot build it
            _GLUON_BROKEN.add(str(q.device))  # must cost speed, not the request
            warnings.warn(f"Gluon prefill failed on {q.device} ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); using the Triton prefill from now on",
                          RuntimeWarning, stacklevel=2)
            kernel = kernel_for(q, k_cache, v_cache)
    if kernel == "tma":
        return prefill_attention_tma(*args, max_seqlen_q=max_seqlen_q, out=out)
    return prefill_attention_ptr(*args, max_seqlen_q=max_seqlen_q, out=out)
