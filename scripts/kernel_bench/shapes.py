"""Shapes, inputs and counts shared by the bench's checks, timings and sweep.

Bytes and FLOPs follow bench/KERNEL_NOTES.md: decode and block attention count the K/V
bytes read (the floor), prefill counts causal FLOPs. ``run`` is scripts/bench_kernels.py's
Run object (``run.tiny``: the CPU dry run's small shapes).
"""

from __future__ import annotations

import torch

from . import paged_inputs as T

H_Q, H_KV, D, DT = 32, 8, 128, torch.bfloat16
PAGES = ((16, 8), (128, 1))  # (page_tokens, pages_per_block): 128-token blocks
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def heads(run):
    """(query heads, KV heads, head_dim) of the run's cases (``--head-dim``; the dry run's
    tiny cases at half of it)."""
    d = run.args.head_dim
    return (4, 2, d // 2) if run.tiny else (H_Q, H_KV, d)


def prefix_case(run, page, ppb):
    """Prefix hits, a long prompt, a chunk and an 8-token verify row on a NaN-poisoned
    cache: (q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)."""
    hq, hkv, d = heads(run)
    plens, qlens = ([40, 30], [40, 7]) if run.tiny else ([4096, 3000, 1500, 777],
                                                        [4096, 1000, 1500, 8])
    kc, vc, cl, bt = T.make_paged(plens, hkv, d, page, ppb, DT, run.dev)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device=run.dev)
    q = T.randn(sum(qlens), hq, d, dtype=DT, device=run.dev)
    return q, kc, vc, cu, cl, bt


def prefill_case(run, t, page, ppb, prefix=0):
    """Timing case: one sequence of ``t`` new tokens after ``prefix`` cached ones."""
    hq, hkv, d = heads(run)
    kc, vc, cl, bt = T.random_paged(1, prefix + t, hkv, d, page, ppb, DT, run.dev)
    q = T.randn(t, hq, d, dtype=DT, device=run.dev)
    cu = torch.tensor([0, t], dtype=torch.int32, device=run.dev)
    return q, kc, vc, cu, cl, bt


def causal_flops(t, hq, d, prefix=0):
    """QK^T and PV over the visible (query, key) pairs: 2 matmuls x 2 FLOP x D x H_q."""
    return 4 * hq * d * (t * prefix + t * (t + 1) // 2)


def decode_bytes(b, ctx, hq, hkv, d, isz=2):
    """K/V read once plus q and out."""
    return 2 * b * ctx * hkv * d * isz + 2 * b * hq * d * isz
