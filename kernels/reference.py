"""Torch references for the paged, head-major KV layout (the ``torch`` backend's ops).

Cache tensors are ``[num_blocks, pages_per_block, H_kv, page_tokens, D]`` (see
docs/ARCHITECTURE.md, 'KV units, pages and the head cut'); a token's slot is
``block_id * block_size + offset_in_block`` with ``block_size = pages_per_block * page_tokens``. These are the ground truth the Triton
kernels are tested against, so they favour clarity over speed: they gather the paged
K/V into contiguous tensors and run plain softmax attention with fp32 accumulation
(float64 inputs stay float64 so tests can build an exact reference). Query head ``h``
reads KV head ``h // (H_q // H_kv)`` (GQA). Outputs come back in the input dtype.

An fp8 cache comes with its scale caches (``k_scale``/``v_scale``: ``[..., page, 1]``
uint8 exponents, kernels/kv_quant.py): stores quantize, reads dequantize to fp32. An fp8
V cache stores each head page transposed, ``[D, page]`` (tokens contiguous), under the
same shape: the PV dot reads V with tokens on its reduction axis, and an e4m3 tile stored
``[page, D]`` would be transposed a byte at a time in shared memory (kernels/kv_quant.py).
A head page is the same bytes either way, so transfers and head cuts do not change.
"""

from __future__ import annotations

import torch

from .kv_quant import dequantize, quantize

__all__ = [
    "block_attention",
    "decode_attention",
    "gather_kv",
    "prefill_attention",
    "slot_coords",
    "store_kv",
    "v_pages",
    "v_token_major",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def slot_coords(slots: torch.Tensor, cache: torch.Tensor):
    """(block, page-in-block, token-in-page) of each slot in a cache of this shape."""
    _, ppb, _, page, _ = cache.shape
    block_size = ppb * page
    block = torch.div(slots, block_size, rounding_mode="floor")
    off = slots - block * block_size
    return block, torch.div(off, page, rounding_mode="floor"), off % page


def v_pages(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 V cache's bytes as ``[num_blocks, ppb, H_kv, D, page]``: its head pages
    as stored (token ``t`` of head ``h`` is ``[..., h, :, t]``)."""
    nb, ppb, h, page, d = cache.shape
    return cache.view(torch.uint8).view(nb, ppb, h, d, page)


def v_token_major(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 V cache's values laid out as a K cache's ([..., page, D]; a copy)."""
    return v_pages(cache).transpose(-1, -2).contiguous().view(cache.dtype)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write token ``i``'s K/V ([N, H_kv, D]) to slot ``slot_mapping[i]``; -1 skips it.
    With scale caches the values are quantized per (token, head) first, V into its
    transposed head pages."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block, page, tok = slot_coords(slots, k_cache)
    # Advanced indices split by slices put the indexed dim first: [n, H_kv, D].
    for x, cache, sc, is_v in ((k, k_cache, k_scale, False), (v, v_cache, v_scale, True)):
        if sc is None:
            cache[block, page, :, tok] = x[keep].to(cache.dtype)
        else:
            data, e = quantize(x[keep])  # torch's CPU indexing takes no fp8: its bytes
            if is_v:
                v_pages(cache)[block, page, :, :, tok] = data.view(torch.uint8)
            else:
                cache.view(torch.uint8)[block, page, :, tok] = data.view(torch.uint8)
            sc[block, page, :, tok] = e[..., None]


def gather_kv(cache, block_table, length: int, scale=None, *, is_v=False) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as a contiguous [length, H_kv, D]
    (dequantized to fp32 when ``scale`` is the cache's scale cache; ``is_v``: an fp8
    cache holding V, whose head pages are transposed)."""
    _, ppb, _, page, _ = cache.shape
    block_size = ppb * page
    pos = torch.arange(length, device=cache.device)
    block = block_table[torch.div(pos, block_size, rounding_mode="floor")].long()
    off = pos % block_size
    idx = (block, torch.div(off, page, rounding_mode="floor"), slice(None), off % page)
    if scale is None:
        return cache[idx]
    data = v_pages(cache)[idx[0], idx[1], :, :, idx[3]] if is_v else cache.view(torch.uint8)[idx]
    return dequantize(data.view(cache.dtype), scale[idx])


def _attend(q, k, v, scale: float, mask=None) -> torch.Tensor:
    """q [M, H_q, D], k/v [L, H_kv, D], mask [M, L] (True = visible) -> [M, H_q, D]."""
    acc = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kk = k.to(acc).repeat_interleave(group, dim=1)
    vv = v.to(acc).repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,lhd->hml", q.to(acc), kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hml,lhd->mhd", p, vv).to(q.dtype)


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                      k_scale=None, v_scale=None):
    """Causal attention of each sequence's new tokens over its whole paged context.

    Query ``i`` of sequence ``b`` sits at position ``context_lens[b] - q_len_b + i`` and
    sees kv positions up to and including it: this covers prefix-cache hits, chunked
    prefill and (k+1)-token verify steps. The chunk's own K/V must already be stored.
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[b], ctx, k_scale)
        v = gather_kv(v_cache, block_tables[b], ctx, v_scale, is_v=True)
        qpos = torch.arange(ctx - (end - start), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        out[start:end] = _attend(q[start:end], k, v, scale, mask)
    return out


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, k_scale=None,
                     v_scale=None):
    """One query per sequence ([B, H_q, D]) over its first ``context_lens[b]`` tokens."""
    out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        k = gather_kv(k_cache, block_tables[b], ctx, k_scale)
        v = gather_kv(v_cache, block_tables[b], ctx, v_scale, is_v=True)
        out[b] = _attend(q[b : b + 1], k, v, scale)[0]
    return out


def block_attention(q, k_block, v_block, k_cache, v_cache, context_lens, block_tables, scale,
                    k_scale=None, v_scale=None):
    """DSpark: the K block positions ([B, K, H_q, D]) attend non-causally to the paged
    context (``context_lens[b]`` tokens) plus all K block positions (k/v_block
    [B, K, H_kv, D], not in the cache). The block rounds to a 16-bit cache's dtype, as
    the kernel reads it; next to an fp8 cache it stays in q's dtype (never stored)."""
    out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        kc = gather_kv(k_cache, block_tables[b], ctx, k_scale)
        vc = gather_kv(v_cache, block_tables[b], ctx, v_scale, is_v=True)
        if k_scale is None:
            kb, vb = k_block[b].to(k_cache.dtype), v_block[b].to(v_cache.dtype)
        else:
            kb, vb = k_block[b].to(q.dtype).float(), v_block[b].to(q.dtype).float()
        k = torch.cat([kc, kb])
        v = torch.cat([vc, vb])
        out[b] = _attend(q[b], k, v, scale)
    return out
