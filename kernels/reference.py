"""Torch references for the paged, head-major KV layout (the ``torch`` backend's ops).

Cache tensors are ``[num_blocks, pages_per_block, H_kv, page_tokens, D]`` (see
docs/ARCHITECTURE.md, 'KV units, pages and the head cut'); a token's slot is
``block_id * block_size + offset_in_block`` with ``block_size = pages_per_block * page_tokens``. These are the ground truth the Triton
kernels are tested against, so they favour clarity over speed: they gather the paged
K/V into contiguous tensors and run plain softmax attention with fp32 accumulation
(float64 inputs stay float64 so tests can build an exact reference). Query head ``h``
reads KV head ``h // (H_q // H_kv)`` (GQA). Outputs come back in the input dtype.
"""

from __future__ import annotations

import torch

__all__ = [
    "block_attention",
    "decode_attention",
    "gather_kv",
    "prefill_attention",
    "slot_coords",
    "store_kv",
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


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write token ``i``'s K/V ([N, H_kv, D]) to slot ``slot_mapping[i]``; -1 skips it."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block, page, tok = slot_coords(slots, k_cache)
    # Advanced indices split by a slice put the indexed dim first: [n, H_kv, D].
    k_cache[block, page, :, tok] = k[keep].to(k_cache.dtype)
    v_cache[block, page, :, tok] = v[keep].to(v_cache.dtype)


def gather_kv(cache, block_table, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as a contiguous [length, H_kv, D]."""
    _, ppb, _, page, _ = cache.shape
    block_size = ppb * page
    pos = torch.arange(length, device=cache.device)
    block = block_table[torch.div(pos, block_size, rounding_mode="floor")].long()
    off = pos % block_size
    return cache[block, torch.div(off, page, rounding_mode="floor"), :, off % page]


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


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
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
        k = gather_kv(k_cache, block_tables[b], ctx)
        v = gather_kv(v_cache, block_tables[b], ctx)
        qpos = torch.arange(ctx - (end - start), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        out[start:end] = _attend(q[start:end], k, v, scale, mask)
    return out


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale):
    """One query per sequence ([B, H_q, D]) over its first ``context_lens[b]`` tokens."""
    out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        k = gather_kv(k_cache, block_tables[b], ctx)
        v = gather_kv(v_cache, block_tables[b], ctx)
        out[b] = _attend(q[b : b + 1], k, v, scale)[0]
    return out


def block_attention(q, k_block, v_block, k_cache, v_cache, context_lens, block_tables, scale):
    """DSpark: the K block positions ([B, K, H_q, D]) attend non-causally to the paged
    context (``context_lens[b]`` tokens) plus all K block positions (k/v_block
    [B, K, H_kv, D], not in the cache)."""
    out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        k = torch.cat([gather_kv(k_cache, block_tables[b], ctx), k_block[b].to(k_cache.dtype)])
        v = torch.cat([gather_kv(v_cache, block_tables[b], ctx), v_block[b].to(v_cache.dtype)])
        out[b] = _attend(q[b], k, v, scale)
    return out
