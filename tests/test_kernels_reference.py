"""The torch references against independent formulations (SDPA, byte offsets)."""

from __future__ import annotations

import pytest
import torch
from pdflow.kernels import reference as ref


def _cache(nb, ppb, h, page, d, dtype=torch.float64):
    return torch.full((nb, ppb, h, page, d), float("nan"), dtype=dtype)


def test_store_kv_places_token_at_head_major_offset():
    nb, ppb, h, page, d = 3, 4, 2, 4, 8
    kc, vc = _cache(nb, ppb, h, page, d), _cache(nb, ppb, h, page, d)
    slots = torch.tensor([0, 5, -1, 47, 20])
    k = torch.randn(5, h, d, dtype=torch.float64)
    v = torch.randn(5, h, d, dtype=torch.float64)
    ref.store_kv(k, v, kc, vc, slots)
    flat = kc.reshape(-1)
    bs = ppb * page
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        p, t = divmod(off, page)
        for hh in range(h):
            # docs/ARCHITECTURE.md, 'KV units, pages and the head cut': head h of page p starts at ((p*H)+h)*page*d in the block.
            base = blk * bs * h * d + ((p * h) + hh) * page * d + t * d
            assert torch.equal(flat[base : base + d], k[i, hh])
    assert int(torch.isnan(kc).any(-1).sum()) == (nb * ppb * page - 4) * h


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_matches_sdpa_on_contiguous_data(group):
    torch.manual_seed(0)
    h_kv, d, page, ppb = 2, 16, 4, 2
    h_q, bs = h_kv * group, page * ppb
    ctxs, qlens = [13, 7], [5, 7]
    nb = 8
    kc, vc = _cache(nb, ppb, h_kv, page, d), _cache(nb, ppb, h_kv, page, d)
    tables = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    ks, vs = [], []
    for b, ctx in enumerate(ctxs):
        k = torch.randn(ctx, h_kv, d, dtype=torch.float64)
        v = torch.randn(ctx, h_kv, d, dtype=torch.float64)
        pos = torch.arange(ctx)
        slots = tables[b].long()[pos // bs] * bs + pos % bs
        ref.store_kv(k, v, kc, vc, slots)
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(qlens), h_q, d, dtype=torch.float64)
    cu = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    out = ref.prefill_attention(q, kc, vc, cu, torch.tensor(ctxs, dtype=torch.int32), tables, 0.3)
    for b, ctx in enumerate(ctxs):
        qb = q[cu[b] : cu[b + 1]].transpose(0, 1)
        kb = ks[b].repeat_interleave(group, 1).transpose(0, 1)
        vb = vs[b].repeat_interleave(group, 1).transpose(0, 1)
        ql = qlens[b]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - ql, ctx)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], want)
        # Decode is prefill with one query at the last position.
        dec = ref.decode_attention(
            q[cu[b + 1] - 1 : cu[b + 1]], kc, vc, torch.tensor([ctx], dtype=torch.int32),
            tables[b : b + 1], 0.3,
        )
        torch.testing.assert_close(dec[0], want[-1])


def test_block_attention_is_noncausal_over_context_plus_block():
    torch.manual_seed(1)
    h_kv, d, page, ppb, kb = 1, 8, 4, 1, 3
    kc, vc = _cache(4, ppb, h_kv, page, d), _cache(4, ppb, h_kv, page, d)
    ctx = 6
    k = torch.randn(ctx + kb, h_kv, d, dtype=torch.float64)
    v = torch.randn(ctx + kb, h_kv, d, dtype=torch.float64)
    tables = torch.tensor([[3, 1]], dtype=torch.int32)
    pos = torch.arange(ctx)
    ref.store_kv(k[:ctx], v[:ctx], kc, vc, tables[0].long()[pos // 4] * 4 + pos % 4)
    q = torch.randn(1, kb, 2, d, dtype=torch.float64)
    out = ref.block_attention(
        q, k[None, ctx:], v[None, ctx:], kc, vc, torch.tensor([ctx], dtype=torch.int32),
        tables, 0.5,
    )
    want = torch.nn.functional.scaled_dot_product_attention(
        q[0].transpose(0, 1), k.expand(-1, 2, -1).transpose(0, 1),
        v.expand(-1, 2, -1).transpose(0, 1), scale=0.5,
    ).transpose(0, 1)
    torch.testing.assert_close(out[0], want)
