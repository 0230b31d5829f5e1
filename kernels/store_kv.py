"""KV write: scatter new tokens' K/V into the paged, head-major cache.

One program per token writes every KV head of both fields; the token axis is grid
axis 0, so any batch size launches (CUDA caps y/z at 65535). ``page_tokens`` and
``pages_per_block`` are compile-time constants, so the page-16 and page-128 bindings
each get their own specialised binary with the slot arithmetic folded to shifts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .reference import store_kv as store_kv_reference

__all__ = ["store_kv", "store_kv_reference"]


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_cp, s_ch, s_ct,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    # Broadcast before comparing: the interpreter mis-types scalar-bool & block-bool.
    keep = (tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot) >= 0
    slot = tl.maximum(slot, 0)
    block = slot // (PAGE * PPB)
    off = slot % (PAGE * PPB)
    page = off // PAGE
    tok = off % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < H)[:, None] & (d < D)[None, :] & keep
    dst = block * s_cb + page * s_cp + tok * s_ct + h[:, None] * s_ch + d[None, :]
    k = tl.load(k_ptr + i * s_kn + h[:, None] * s_kh + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + i * s_vn + h[:, None] * s_vh + d[None, :], mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping, num_warps: int | None = None) -> None:
    """Write token ``i``'s K/V ([N, H_kv, D]) to slot ``slot_mapping[i]`` (-1 skips)."""
    n, h, d = k.shape
    _, ppb, hc, page, dc = k_cache.shape
    assert (h, d) == (hc, dc) and v.shape == k.shape and v_cache.shape == k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    if n == 0:
        return
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    if num_warps is None:
        num_warps = 4 if block_h * block_d >= 1024 else 1
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:4],
        H=h, D=d, PAGE=page, PPB=ppb, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=num_warps,
    )
