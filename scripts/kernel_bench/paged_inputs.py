"""Paged K/V inputs shared by the kernel tests and scripts/bench_kernels.py.

Every cache slot that no sequence owns, and every block-table entry past a sequence's
last block, holds NaN (through a reserved "poison" block), so a kernel that reads one
token too far returns NaN and fails the comparison instead of passing silently.
"""

from __future__ import annotations

import torch
from pdflow.kernels import reference as ref


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    """||out - want|| / ||want|| in float64; NaN anywhere gives NaN (never passes)."""
    out, want = out.double(), want.double()
    return float((out - want).norm() / want.norm())


def make_paged(lens, h_kv, d, page, ppb, dtype, device="cpu", seed=0, spare_blocks=2):
    """Random K/V for sequences of ``lens`` tokens stored at shuffled blocks of a NaN
    cache. Returns (k_cache, v_cache, context_lens int32, block_tables int32)."""
    gen = torch.Generator().manual_seed(seed)
    bs = page * ppb
    per_seq = [-(-n // bs) for n in lens]
    nb = sum(per_seq) + spare_blocks
    perm = torch.randperm(nb, generator=gen)
    poison = int(perm[-1])  # never written: every unused table entry points at NaN
    width = max(per_seq) + 1
    tables = torch.full((len(lens), width), poison, dtype=torch.int32)
    k_cache = torch.full((nb, ppb, h_kv, page, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, n in enumerate(lens):
        blocks = perm[used : used + per_seq[b]]
        used += per_seq[b]
        tables[b, : per_seq[b]] = blocks.int()
        pos = torch.arange(n)
        slots = (blocks[pos // bs].long() * bs + pos % bs).to(device)
        k = torch.randn(n, h_kv, d, generator=gen).to(device)
        v = torch.randn(n, h_kv, d, generator=gen).to(device)
        ref.store_kv(k, v, k_cache, v_cache, slots)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return k_cache, v_cache, lens_t.to(device), tables.to(device)


def random_paged(batch, ctx, h_kv, d, page, ppb, dtype, device, seed=0):
    """Timing-only cache: ``batch`` sequences of ``ctx`` tokens on shuffled blocks of a
    fully random cache (no poison; values do not matter for speed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-ctx // (page * ppb))
    nb = batch * per_seq
    k_cache = torch.randn(nb, ppb, h_kv, page, d, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(nb, ppb, h_kv, page, d, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(nb, device=device, generator=gen)
    tables = perm.view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return k_cache, v_cache, lens, tables


def randn(*shape, dtype, device="cpu", seed=1) -> torch.Tensor:
    """Seeded normal values drawn on the CPU, so every device sees the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def as64(*tensors):
    """float64 copies, for the references."""
    return [t.double() for t in tensors]
