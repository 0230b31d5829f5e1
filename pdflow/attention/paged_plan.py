"""Per-step index and mask tensors for the batched torch backend, built once per step.

Every layer of a step attends with the same block tables and lengths, so the page rows
to gather, the masks and the store slots are derived once (on the first layer) and
reused by the rest. Cache tensors are ``[num_blocks, pages_per_block, H_kv, page, D]``
(see docs/ARCHITECTURE.md, 'KV units, pages and the head cut'): viewed as rows of ``D``
elements, token ``t`` of head ``h`` of page ``p`` (pages flattened over blocks) is row
``(p * H_kv + h) * page + t``, so one
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
    head_dim: int
    # An fp8 cache: V's head pages are stored [D, page] (kernels/reference.py), so its
    # rows are moved element by element (``v_elements``).
    v_transposed: bool

    @classmethod
    def of(cls, cache: torch.Tensor) -> Geometry:
        _, ppb, h_kv, page, d = cache.shape
        return cls(ppb, h_kv, page, d, cache.element_size() == 1)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, float64 kept (as the reference does)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class StorePlan:
    # [n * H_kv] rows of cache.view(-1, D) receiving each kept token's heads, in order.
    rows: torch.Tensor
    # [n] tokens kept (slot >= 0), or None when every token is stored.
    keep: torch.Tensor | None
    # [n * H_kv * D] element offsets of ``rows`` in an fp8 V cache, or None.
    v_elements: torch.Tensor | None


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
    rows = ((page_row[:, None] * geo.num_kv_heads + heads) * geo.page_tokens + tok[:, None]).flatten()
    return StorePlan(rows=rows, keep=keep, v_elements=v_elements(rows, geo))


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """Cache rows (of ``D`` elements) to gather for B sequences of up to ``length`` tokens."""

    rows: torch.Tensor  # [B * H_kv * length] into cache.view(-1, D)
    batch: int
    length: int
    # [B * H_kv * length * D] element offsets of ``rows`` in an fp8 V cache, or None.
    v_elements: torch.Tensor | None


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
    rows = (rows + (off % page)[:, None, :]).flatten()
    return GatherPlan(rows=rows, batch=block_tables.shape[0], length=max_ctx,
                      v_elements=v_elements(rows, geo))


def v_elements(rows: torch.Tensor, geo: Geometry) -> torch.Tensor | None:
    """Flat element offsets of cache rows in a cache whose head pages are stored
    [D, page] (an fp8 V cache, kernels/reference.py): row ``r = page_head * page + t``
    holds elements ``page_head * page * D + i * page + t``; None for other caches."""
    if not geo.v_transposed:
        return None
    page, d = geo.page_tokens, geo.head_dim
    t = rows % page
    base = (rows - t) * d + t
    return (base[:, None] + torch.arange(d, device=rows.device) * page).flatten()


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


# Chunks at least this long attend one sequence at a time (exact length, no padding,
# causal block skipping when the chunk is the whole context); shorter ones (decode rows,
# verify chunks) are padded into one batched call. Measured on CPU: padding a batch of
# 32..128-token prompts to the longest cost 2-4x the per-sequence calls.
LONG_CHUNK = 16


@dataclass(frozen=True, slots=True)
class PaddedGroup:
    """Short chunks padded to ``max_q`` query rows each, attended in one call."""

    gather: GatherPlan
    # [B', max_q] row of q for each padded query (padding repeats a real row).
    q_rows: torch.Tensor
    # [T'] row of the padded output [B' * max_q] holding each token's result ...
    out_rows: torch.Tensor
    # ... and that token's row in q.
    token_rows: torch.Tensor
    # [B', 1, max_q, L] additive causal mask over the context.
    bias: torch.Tensor


@dataclass(frozen=True, slots=True)
class LongChunk:
    gather: GatherPlan  # this one sequence
    start: int
    end: int
    # None when the chunk is the whole context (top-left causal); else [q, ctx] bias.
    bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    padded: PaddedGroup | None
    long: list[LongChunk]


def _causal_bias(ctx, qlen, max_q: int, length: int, dtype) -> torch.Tensor:
    """[B, max_q, length]: query i of a chunk of ``qlen`` ending at ``ctx`` sees keys
    ``j <= ctx - qlen + i`` (and none past ``ctx``)."""
    device = ctx.device
    i = torch.arange(max_q, device=device)
    j = torch.arange(length, device=device)
    qpos = (ctx - qlen)[:, None] + i[None, :]
    hidden = (j[None, None, :] > qpos[:, :, None]) | (j[None, None, :] >= ctx[:, None, None])
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def prefill_plan(cu_seqlens_q, context_lens, block_tables, geo: Geometry,
                 dtype: torch.dtype) -> PrefillPlan:
    cu = cu_seqlens_q.long()
    ctx_all = context_lens.long()
    starts, lens, ctxs = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist(), ctx_all.tolist()
    long, short = [], []
    for b, (start, qlen, ctx) in enumerate(zip(starts, lens, ctxs, strict=True)):
        if qlen >= LONG_CHUNK:
            gather = gather_plan(block_tables[b : b + 1], ctx_all[b : b + 1], ctx, geo)
            bias = None
            if qlen != ctx:
                bias = _causal_bias(ctx_all[b : b + 1], cu.new_tensor([qlen]), qlen, ctx, dtype)[0]
            long.append(LongChunk(gather=gather, start=start, end=start + qlen, bias=bias))
        elif qlen > 0:
            short.append(b)
    return PrefillPlan(padded=_padded_group(short, cu, ctx_all, block_tables, geo, dtype),
                       long=long)


def _padded_group(short: list[int], cu, ctx_all, block_tables, geo, dtype) -> PaddedGroup | None:
    if not short:
        return None
    device = ctx_all.device
    idx = torch.tensor(short, device=device)
    start, qlen, ctx = cu[:-1][idx], (cu[1:] - cu[:-1])[idx], ctx_all[idx]
    max_q, max_ctx = (int(x) for x in torch.stack([qlen.max(), ctx.max()]).tolist())
    gather = gather_plan(block_tables[idx], ctx, max_ctx, geo)
    i = torch.arange(max_q, device=device)
    q_rows = start[:, None] + torch.minimum(i[None, :], qlen[:, None] - 1)
    valid = i[None, :] < qlen[:, None]
    out_rows = (torch.arange(len(short), device=device)[:, None] * max_q + i)[valid]
    bias = _causal_bias(ctx, qlen, max_q, max_ctx, dtype)[:, None]
    return PaddedGroup(gather=gather, q_rows=q_rows, out_rows=out_rows,
                       token_rows=(start[:, None] + i)[valid], bias=bias)
