"""Per-step index and mask tensors for the batched torch backend, built once per step.

Every layer of a step attends with the same block tables and lengths, so the page rows
to gather, the masks and the store slots are derived once (on the first layer) and
reused by the rest. Cache tensors are ``[num_blocks, pages_per_block, H_kv, page, D]``
(DESIGN section 3): viewed as rows of ``D`` elements, token ``t`` of head ``h`` of
page ``p`` (pages flattened over blocks) is row ``(p * H_kv + h) * page + t``, so one
``index_select`` of rows ordered ``[b, h, position]`` yields every sequence's K or V as
a contiguous ``[B, H_kv, L, D]`` (L: the longest context; shorter ones are masked).
Gathering tokens rather than whole pages measured as fast on CPU and needs no page
rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the derived indices depend on besides the metadata."""

    pages_per_block: int
    num_kv_heads: int
    page_tokens: int

    @classmethod
    def of(cls, cache: torch.Tensor) -> Geometry:
        _, ppb, h_kv, page, _ = cache.shape
        return cls(ppb, h_kv, page)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, float64 kept (as the reference does)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class StorePlan:
    # [n * H_kv] rows of cache.view(-1, D) receiving each kept token's heads, in order.
    rows: torch.Tensor
    # [n] tokens kept (slot >= 0), or None when every token is stored.
    keep: torch.Tensor | None


def store_plan(slot_mapping: torch.Tensor, geo: Geometry) -> StorePlan:
    slots = slot_mapping.long()
    keep = None
    if bool((slots < 0).any()):
        keep = torch.nonzero(slots >= 0).flatten()
        slots = slots[keep]
    block_size = geo.pages_per_block * geo.page_tokens
    block = torch.div(slots, block_size, rounding_mode="floor")
    off = slots - block * block_size
    page_row = block * geo.pages_per_block + torch.div(off, geo.page_tokens, rounding_mode="floor")
    tok = off % geo.page_tokens
    heads = torch.arange(geo.num_kv_heads, device=slots.device)
    rows = ((page_row[:, None] * geo.num_kv_heads + heads) * geo.page_tokens + tok[:, None])
    return StorePlan(rows=rows.flatten(), keep=keep)


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """Cache rows (of ``D`` elements) to gather for B sequences of up to ``length`` tokens."""

    rows: torch.Tensor  # [B * H_kv * length] into cache.view(-1, D)
    batch: int
    length: int


def gather_plan(block_tables: torch.Tensor, ctx: torch.Tensor, max_ctx: int,
                geo: Geometry) -> GatherPlan:
    """``block_tables`` [B, max_blocks] and ``ctx`` [B] of the sequences to attend.
    Positions at or past a sequence's length read its token 0 instead: they are masked,
    and reading a written slot keeps stale or unwritten cache contents (even inf/NaN)
    out of the result (0 * NaN would not be 0)."""
    device = block_tables.device
    pos = torch.arange(max_ctx, device=device)
    pos = torch.where(pos[None, :] < ctx[:, None], pos[None, :], 0)  # [B, L]
    ppb, page = geo.pages_per_block, geo.page_tokens
    block_size = ppb * page
    blocks = block_tables.long().gather(1, torch.div(pos, block_size, rounding_mode="floor"))
    off = pos % block_size
    page_rows = blocks * ppb + torch.div(off, page, rounding_mode="floor")
    heads = torch.arange(geo.num_kv_heads, device=device)
    rows = (page_rows[:, None, :] * geo.num_kv_heads + heads[None, :, None]) * page
    rows = rows + (off % page)[:, None, :]
    return GatherPlan(rows=rows.flatten(), batch=block_tables.shape[0], length=max_ctx)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    gather: GatherPlan
    # [B * H_kv, 1, L] additive mask: 0 for positions < context_len, -inf after.
    bias: torch.Tensor


def decode_plan(context_lens, block_tables, geo: Geometry, dtype: torch.dtype) -> DecodePlan:
    ctx = context_lens.long()
    gather = gather_plan(block_tables, ctx, int(ctx.max()), geo)
    length = gather.length
    pos = torch.arange(length, device=ctx.device)
    bias = torch.zeros(ctx.shape[0], length, dtype=dtype, device=ctx.device)
    bias.masked_fill_(pos[None, :] >= ctx[:, None], float("-inf"))
    bias = bias.repeat_interleave(geo.num_kv_heads, dim=0)[:, None, :]
    return DecodePlan(gather=gather, bias=bias)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The sequences with new tokens, padded to ``max_q`` query rows each."""

    gather: GatherPlan
    # [B', max_q] row of q for each padded query (padding repeats a real row).
    q_rows: torch.Tensor
    # [T] row of the padded output [B' * max_q] holding each token's result.
    out_rows: torch.Tensor
    # [B', 1, max_q, L] additive causal mask over the context.
    bias: torch.Tensor
    max_q: int


def prefill_plan(cu_seqlens_q, context_lens, block_tables, geo: Geometry,
                 dtype: torch.dtype) -> PrefillPlan:
    device = context_lens.device
    cu = cu_seqlens_q.long()
    qlen_all = cu[1:] - cu[:-1]
    active = torch.nonzero(qlen_all > 0).flatten()
    qlen, start = qlen_all[active], cu[:-1][active]
    ctx = context_lens.long()[active]
    max_q, max_ctx = (int(x) for x in torch.stack([qlen.max(), ctx.max()]).tolist())
    gather = gather_plan(block_tables[active], ctx, max_ctx, geo)
    i = torch.arange(max_q, device=device)
    q_rows = start[:, None] + torch.minimum(i[None, :], qlen[:, None] - 1)
    valid = i[None, :] < qlen[:, None]
    out_rows = (torch.arange(len(active), device=device)[:, None] * max_q + i)[valid]
    length = gather.length
    j = torch.arange(length, device=device)
    qpos = (ctx - qlen)[:, None] + i[None, :]  # [B', max_q]
    hidden = (j[None, None, :] > qpos[:, :, None]) | (j[None, None, :] >= ctx[:, None, None])
    bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return PrefillPlan(gather=gather, q_rows=q_rows, out_rows=out_rows, bias=bias[:, None],
                       max_q=max_q)
