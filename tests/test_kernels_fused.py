"""Fused elementwise kernels (RMSNorm + residual, SiLU-and-mul, RoPE on qkv with qk-norm
and the KV write) against their torch references, on CPU under TRITON_INTERPRET and on
CUDA when there is one. Fresh random inputs per case, odd sizes, NaN-poisoned outputs.

fp32 is held to a few ulps (sums taken in another order). The interpreter rounds fp32 ->
bf16 by truncation (the GPU rounds to nearest even), so bf16 there is held to a few ulps
and a floor of two ulps of the largest value (RoPE's sums cancel); fp16 everywhere and
bf16 on the GPU must also match bit for bit on almost every element (fp32 noise rarely
crosses a 16-bit rounding boundary).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels import reference_fused as fref  # noqa: E402
from pdflow.kernels.qk_rope import qk_rope_  # noqa: E402
from pdflow.kernels.rms_norm import rms_norm  # noqa: E402
from pdflow.kernels.silu_and_mul import silu_and_mul  # noqa: E402

from pdflow.model.rope import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tolerance(dtype) -> tuple[float, float, float]:
    """(max ulps, min fraction of bit-exact elements, error floor as a fraction of the
    largest expected value: cancellation in RoPE's sums of products) for this dtype."""
    f32 = torch.finfo(torch.float32).eps
    if dtype == torch.float32:  # statistics summed in another order: last-bits noise
        return 16.0, 0.0, 16 * f32
    if dtype == torch.bfloat16 and DEV == "cpu":  # truncations compound over 3 roundings
        return 4.0, 0.0, 2 * torch.finfo(dtype).eps
    return 2.0, 0.98, 16 * f32


def assert_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every element within the dtype's ulp budget of ``want`` (spacing at want's size,
    or the floor), and most bit-exact where the dtype asks; NaN anywhere fails."""
    max_ulps, min_exact, floor_frac = _tolerance(want.dtype)
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    assert g.shape == w.shape and not torch.isnan(g).any(), "NaN or shape mismatch"
    info = torch.finfo(want.dtype)
    spacing = info.eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(info.tiny))))
    floor = max(floor_frac * float(w.abs().max()), info.tiny)
    ulps = (g - w).abs() / spacing.clamp_min(floor)
    assert float(ulps.max()) <= max_ulps, f"{float(ulps.max()):.1f} ulps off"
    exact = float((g == w).double().mean())
    assert exact >= min_exact, f"only {exact:.3f} of elements bit-exact"


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# -- RMSNorm ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 7), (5, 96), (33, 1000), (3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, rows, n, with_residual):
    gen = torch.Generator().manual_seed(rows * 1000 + n + with_residual)
    x = _randn(rows, n, dtype=dtype, gen=gen, scale=3.0)
    w = _randn(n, dtype=dtype, gen=gen)
    res = _randn(rows, n, dtype=dtype, gen=gen) if with_residual else None
    want = fref.rms_norm(x, w, 1e-6, res)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=DEV)
    res_out = torch.full_like(out, float("nan")) if with_residual else None
    got = rms_norm(x.to(DEV), w.to(DEV), 1e-6, None if res is None else res.to(DEV),
                   out=out, residual_out=res_out)
    if with_residual:
        assert got[0] is out and got[1] is res_out
        assert_ulps(got[0], want[0])
        # The sum is one rounding of an exact fp32 sum: at most one ulp (truncation).
        assert_ulps(got[1], want[1])
    else:
        assert got is out
        assert_ulps(got, want)


def test_rms_norm_3d_and_empty():
    gen = torch.Generator().manual_seed(5)
    x = _randn(2, 3, 40, dtype=torch.float16, gen=gen)
    w = _randn(40, dtype=torch.float16, gen=gen)
    assert_ulps(rms_norm(x.to(DEV), w.to(DEV), 1e-5), fref.rms_norm(x, w, 1e-5))
    empty = torch.empty(0, 40, dtype=torch.float16, device=DEV)
    assert rms_norm(empty, w.to(DEV), 1e-5).shape == (0, 40)


def test_rms_norm_check_catches_a_dropped_residual():
    """The comparison can fail: a norm that forgot the residual is far off."""
    gen = torch.Generator().manual_seed(2)
    x, r = _randn(4, 64, dtype=torch.float32, gen=gen), _randn(4, 64, dtype=torch.float32, gen=gen)
    w = _randn(64, dtype=torch.float32, gen=gen)
    want, _ = fref.rms_norm(x, w, 1e-6, r)
    with pytest.raises(AssertionError):
        assert_ulps(rms_norm(x.to(DEV), w.to(DEV), 1e-6), want)


# -- SiLU-and-mul -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,i", [(1, 5), (17, 333), (4, 3072)])
def test_silu_and_mul_matches_reference(dtype, rows, i):
    gen = torch.Generator().manual_seed(rows + i)
    gu = _randn(rows, 2 * i, dtype=dtype, gen=gen, scale=3.0)
    out = torch.full((rows, i), float("nan"), dtype=dtype, device=DEV)
    got = silu_and_mul(gu.to(DEV), out=out, block=256)
    assert got is out
    assert_ulps(got, fref.silu_and_mul(gu))


def test_silu_and_mul_check_catches_swapped_halves():
    gen = torch.Generator().manual_seed(4)
    gu = _randn(3, 64, dtype=torch.float32, gen=gen)
    swapped = torch.cat(gu.chunk(2, dim=-1)[::-1], dim=-1)
    with pytest.raises(AssertionError):
        assert_ulps(silu_and_mul(gu.to(DEV)), fref.silu_and_mul(swapped))


# -- RoPE on qkv ------------------------------------------------------------------------


def _rope_case(t, hq, hkv, d, dtype, qk_norm, seed):
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d, 10000.0, None, 300)
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, gen=gen, scale=2.0)
    pos = torch.randint(0, 300, (t,), generator=gen)
    weights = (_randn(d, dtype=dtype, gen=gen), _randn(d, dtype=dtype, gen=gen)) if qk_norm else (None, None)
    return rope, qkv, pos, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 2, 1, 16), (9, 6, 2, 48), (13, 16, 8, 128), (5, 3, 3, 64)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_rope_matches_reference(dtype, t, hq, hkv, d, qk_norm):
    rope, qkv, pos, (qw, kw) = _rope_case(t, hq, hkv, d, dtype, qk_norm, seed=t * 7 + hq + d)
    want_q, want_k, want_v = fref.qk_rope(qkv, pos, rope.cos, rope.sin, hq, hkv, d, qw, kw)
    dev = qkv.to(DEV)
    q, k, v = qk_rope_(
        dev, pos.to(DEV), rope.cos.to(DEV), rope.sin.to(DEV), hq, hkv, d,
        q_weight=None if qw is None else qw.to(DEV), k_weight=None if kw is None else kw.to(DEV),
    )
    assert q.data_ptr() == dev.data_ptr()  # in place: views of qkv
    assert_ulps(q, want_q)
    assert_ulps(k, want_k)
    assert torch.equal(v.cpu(), want_v)  # v untouched


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
])
@pytest.mark.parametrize("page,ppb", [(16, 2), (128, 1)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_rope_writes_kv_cache(dtype, cache_dtype, page, ppb, qk_norm):
    t, hq, hkv, d, nb = 37, 4, 2, 64, 4
    rope, qkv, pos, (qw, kw) = _rope_case(t, hq, hkv, d, dtype, qk_norm, seed=page + ppb)
    gen = torch.Generator().manual_seed(11)
    slots = torch.randperm(nb * page * ppb, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.2] = -1
    shape = (nb, ppb, hkv, page, d)
    want_kc, want_vc = (torch.full(shape, float("nan"), dtype=cache_dtype) for _ in range(2))
    _, want_k, want_v = fref.qk_rope(qkv, pos, rope.cos, rope.sin, hq, hkv, d, qw, kw)
    ref.store_kv(want_k, want_v, want_kc, want_vc, slots)
    kc, vc = (torch.full(shape, float("nan"), dtype=cache_dtype, device=DEV) for _ in range(2))
    qk_rope_(
        qkv.to(DEV), pos.to(DEV), rope.cos.to(DEV), rope.sin.to(DEV), hq, hkv, d,
        q_weight=None if qw is None else qw.to(DEV), k_weight=None if kw is None else kw.to(DEV),
        k_cache=kc, v_cache=vc, slot_mapping=slots.to(DEV),
    )
    # Skipped and unowned slots stay NaN; written ones hold the rotated k and the v.
    assert torch.equal(torch.isnan(kc.cpu()), torch.isnan(want_kc))
    assert torch.equal(torch.isnan(vc.cpu()), torch.isnan(want_vc))
    keep = ~torch.isnan(want_kc)
    assert int(keep.sum()) == int((slots >= 0).sum()) * hkv * d
    assert_ulps(kc.cpu()[keep], want_kc[keep])
    assert torch.equal(vc.cpu()[keep], want_vc[keep])


def test_qk_rope_check_catches_wrong_positions_and_missing_norm():
    rope, qkv, pos, (qw, kw) = _rope_case(6, 4, 2, 32, torch.float32, True, seed=3)
    q, k, _ = qk_rope_(qkv.clone().to(DEV), pos.to(DEV), rope.cos.to(DEV), rope.sin.to(DEV),
                       4, 2, 32, q_weight=qw.to(DEV), k_weight=kw.to(DEV))
    shifted, _, _ = fref.qk_rope(qkv, (pos + 1) % 300, rope.cos, rope.sin, 4, 2, 32, qw, kw)
    unnormed, _, _ = fref.qk_rope(qkv, pos, rope.cos, rope.sin, 4, 2, 32)
    for wrong in (shifted, unnormed):
        with pytest.raises(AssertionError):
            assert_ulps(q, wrong)
