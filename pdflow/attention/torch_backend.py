"""The ``torch`` backend: batched paged attention in plain torch (the CPU serving path).

Same signatures and results as ``pdflow.kernels.reference`` (the oracle, which loops
over sequences for clarity), but every op is batched: the K/V of all sequences are
gathered with one ``index_select`` of cache rows, decode runs two batched matmuls with
an additive length mask, and prefill runs ``scaled_dot_product_attention`` per long
chunk (no padding) plus one masked call over the short chunks padded together. The index and mask tensors come from
``paged_plan`` once per step (memoised on the identity of the metadata tensors, which
every layer of a step shares) and the gather buffers are reused by every layer, so a
decode step allocates no large tensor per layer.

The memo keys on tensor identity: metadata tensors must not be changed in place once
built (``AttentionMetadata`` builds new ones every step). One backend instance serves
one model's layers, run one at a time.

An fp8 cache comes with its scale caches (``k_scale``/``v_scale``, kernels/kv_quant.py):
the store quantizes, and every read gathers the scale rows with the same row index
(a scale cache is its cache with D = 1) and dequantizes before the matmuls, so each
value read equals the reference's exactly. An fp8 V cache's head pages are transposed
([D, page], kernels/reference.py): its rows are moved element by element, through the
plans' ``v_elements``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdflow.attention import cpu_decode
from pdflow.attention import paged_plan as plans
from pdflow.attention.backends import register_backend
from pdflow.kernels import reference
from pdflow.kernels.kv_quant import dequantize, quantize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes (same shape); other tensors as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class _Memo:
    """The plan built from the last metadata tensors seen (held, so ids stay unique)."""

    def __init__(self):
        self._key: tuple = ()
        self._plans: dict = {}

    def get(self, tensors: tuple, extra, build):
        if len(tensors) != len(self._key) or any(a is not b for a, b in zip(tensors, self._key, strict=True)):
            self._key, self._plans = tensors, {}
        plan = self._plans.get(extra)
        if plan is None:
            plan = self._plans[extra] = build()
        return plan


class TorchBackend:
    name = "torch"
    block_attention = staticmethod(reference.block_attention)

    def __init__(self):
        self._store, self._decode, self._prefill = _Memo(), _Memo(), _Memo()
        self._buffers: dict[tuple, torch.Tensor] = {}

    # -- helpers ----------------------------------------------------------------------

    def _buffer(self, which: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A reusable flat buffer, grown when short: large per-layer allocations cost
        page faults on CPU."""
        key = (which, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def _gather(self, cache: torch.Tensor, gather: plans.GatherPlan, which: str):
        """[B, H_kv, L, D] of every planned sequence (contiguous)."""
        _, _, h_kv, _, d = cache.shape
        raw = _bytes(cache)  # torch's CPU index ops take no fp8: move its bytes
        out = self._buffer(which, raw, gather.rows.numel() * d).view(-1, d)
        torch.index_select(raw.view(-1, d), 0, gather.rows, out=out)
        return out.view(cache.dtype).view(gather.batch, h_kv, gather.length, d)

    def _read(self, cache, scale_cache, gather: plans.GatherPlan, which: str, acc):
        """The gathered K or V in ``acc``, dequantized when the cache has scales."""
        if scale_cache is None:
            return self._gather(cache, gather, which).to(acc)
        if which == "v":
            x = _bytes(cache).view(-1).index_select(0, gather.v_elements).view(cache.dtype)
            x = x.view(gather.batch, cache.shape[2], gather.length, cache.shape[-1])
        else:
            x = self._gather(cache, gather, which)
        return dequantize(x, self._gather(scale_cache, gather, which + "_scale")).to(acc)

    @staticmethod
    def _contiguous(*caches) -> bool:
        return all(c is None or c.is_contiguous() for c in caches)

    # -- ops ----------------------------------------------------------------------------

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        """Write token ``i``'s K/V ([N, H_kv, D]) to slot ``slot_mapping[i]``; -1 skips it."""
        if not self._contiguous(k_cache, v_cache, k_scale, v_scale):
            return reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        geo = plans.Geometry.of(k_cache)
        plan = self._store.get((slot_mapping,), geo, lambda: plans.store_plan(slot_mapping, geo))
        d = k_cache.shape[-1]
        for src, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            if plan.keep is not None:
                src = src[plan.keep]
            rows = src.reshape(-1, d)
            if sc is None:
                cache.view(-1, d).index_copy_(0, plan.rows, rows.to(cache.dtype))
                continue
            data, e = quantize(rows)
            if cache is v_cache:
                _bytes(cache).view(-1).index_copy_(0, plan.v_elements, _bytes(data).flatten())
            else:
                _bytes(cache).view(-1, d).index_copy_(0, plan.rows, _bytes(data))
            sc.view(-1, 1).index_copy_(0, plan.rows, e[:, None])

    def decode_attention(self, q, k_cache, v_cache, context_lens, block_tables, scale,
                         k_scale=None, v_scale=None):
        """One query per sequence ([B, H_q, D]) over its first ``context_lens[b]`` tokens."""
        if not self._contiguous(k_cache, v_cache, k_scale, v_scale):
            return reference.decode_attention(q, k_cache, v_cache, context_lens, block_tables,
                                              scale, k_scale, v_scale)
        if k_scale is None and cpu_decode.usable(q, k_cache, v_cache):  # reads K/V in place
            return cpu_decode.decode_attention(q, k_cache, v_cache, context_lens, block_tables,
                                               scale)
        acc = plans.acc_dtype(q.dtype)
        geo = plans.Geometry.of(k_cache)
        plan = self._decode.get(
            (context_lens, block_tables), (geo, acc),
            lambda: plans.decode_plan(context_lens, block_tables, geo, acc),
        )
        b, h_q, d = q.shape
        h_kv = geo.num_kv_heads
        k = self._read(k_cache, k_scale, plan.gather, "k", acc).flatten(0, 1)  # [B*H_kv, L, D]
        v = self._read(v_cache, v_scale, plan.gather, "v", acc).flatten(0, 1)
        # GQA: the query heads sharing KV head h are rows of one [group, D] matrix.
        qg = q.to(acc).reshape(b * h_kv, h_q // h_kv, d)
        scores = torch.baddbmm(plan.bias, qg, k.transpose(1, 2), alpha=scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)
        return out.view(b, h_q, d).to(q.dtype)

    def prefill_attention(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                          scale, *, max_seqlen_q=None, k_scale=None, v_scale=None, out=None):
        """Causal attention of each sequence's new tokens over its whole paged context
        (prefix-cache hits, chunked prefill, verify chunks); chunk K/V already stored.
        ``max_seqlen_q`` is not needed here (the per-step plan reads the lengths once).
        ``out``: written and returned (the triton backend's kernels write into it)."""
        res = self._prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                      scale, k_scale, v_scale)
        return res if out is None else out.copy_(res)

    def _prefill_attention(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                           scale, k_scale, v_scale):
        if q.shape[0] == 0 or not self._contiguous(k_cache, v_cache, k_scale, v_scale):
            return reference.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens,
                                               block_tables, scale, k_scale, v_scale)
        acc = plans.acc_dtype(q.dtype)
        geo = plans.Geometry.of(k_cache)
        plan = self._prefill.get(
            (cu_seqlens_q, context_lens, block_tables), (geo, acc),
            lambda: plans.prefill_plan(cu_seqlens_q, context_lens, block_tables, geo, acc),
        )
        _, h_q, d = q.shape
        gqa = h_q != geo.num_kv_heads
        qa = q.to(acc)
        out = torch.empty_like(qa)
        for chunk in plan.long:
            k = self._read(k_cache, k_scale, chunk.gather, "k", acc)
            v = self._read(v_cache, v_scale, chunk.gather, "v", acc)
            qc = qa[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, H_q, q, D]
            res = F.scaled_dot_product_attention(
                qc, k, v, attn_mask=chunk.bias, is_causal=chunk.bias is None, scale=scale,
                enable_gqa=gqa,
            )
            out[chunk.start : chunk.end] = res[0].transpose(0, 1)
        group = plan.padded
        if group is not None:
            k = self._read(k_cache, k_scale, group.gather, "k", acc)
            v = self._read(v_cache, v_scale, group.gather, "v", acc)
            qp = qa[group.q_rows].transpose(1, 2)  # [B', H_q, max_q, D]
            res = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=group.bias, scale=scale, enable_gqa=gqa
            )
            res = res.transpose(1, 2).reshape(-1, h_q, d)  # [B' * max_q, H_q, D]
            out.index_copy_(0, group.token_rows, res.index_select(0, group.out_rows))
        return out.to(q.dtype)


register_backend("torch", TorchBackend)
