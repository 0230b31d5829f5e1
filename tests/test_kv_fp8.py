"""fp8 (e4m3) KV with a power-of-two scale per (token, KV head): the quantizer, the torch
backend and the Triton kernels (CPU: TRITON_INTERPRET) against the torch reference, and
the graph's scale units, cuts and bytes. Each check is shown able to fail (another head's
scales, or a cache read without its scales, is caught)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.interpreter import use_interpreter_if_no_cuda  # noqa: E402
from pdflow.kernels.kv_quant import FP8, dequantize, quantize  # noqa: E402

from pdflow import compose  # noqa: E402
from pdflow.attention.torch_backend import TorchBackend  # noqa: E402
from pdflow.graph import Code, build_graph  # noqa: E402

use_interpreter_if_no_cuda()
from pdflow.kernels.block_attention import block_attention  # noqa: E402
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402
from pdflow.kernels.prefill_attention import prefill_attention  # noqa: E402
from pdflow.kernels.store_kv import store_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NB, PPB, H, PAGE, D = 6, 2, 2, 16, 64  # two 32-token blocks per sequence, page 16


def _caches(device="cpu"):
    data = [torch.zeros(NB, PPB, H, PAGE, D, dtype=FP8, device=device) for _ in range(2)]
    scales = [torch.zeros(NB, PPB, H, PAGE, 1, dtype=torch.uint8, device=device) for _ in range(2)]
    return data + scales


def _bytes(caches):
    return [c.view(torch.uint8).cpu() for c in caches]


def _kv(seed=0, n=40):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NB * PPB * PAGE, generator=gen)[:n]
    slots[:3] = -1
    # K wide, V with many tiny values (the flush-to-zero edge), heads of different scale.
    k = torch.randn(n, H, D, generator=gen) * torch.tensor([3.0, 0.05])[None, :, None]
    v = torch.randn(n, H, D, generator=gen) ** 3 * 1e-2
    return slots, k, v


def _filled(seed=0):
    """Caches holding every slot of the 6 blocks (two sequences of 3 blocks)."""
    gen = torch.Generator().manual_seed(seed)
    n = NB * PPB * PAGE
    k = torch.randn(n, H, D, generator=gen) * torch.tensor([2.0, 0.3])[None, :, None]
    v = torch.randn(n, H, D, generator=gen)
    caches = _caches()
    ref.store_kv(k, v, *caches[:2], torch.arange(n), *caches[2:])
    return caches


BT = torch.arange(NB, dtype=torch.int32).view(2, 3)
LENS = torch.tensor([70, 90], dtype=torch.int32)


def _other_heads(scale):
    return scale.roll(1, dims=2)  # every head gets its neighbour's scales


# -- the quantizer ----------------------------------------------------------------------

def test_quantize_keeps_fp8_precision_and_dequantize_is_exact():
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(1)) * 10
    q, e = quantize(x)
    y = dequantize(q, e)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value (flushed values aside).
    big = x.abs() >= x.abs().amax(-1, keepdim=True) * 2.0**-10
    assert ((y - x).abs() <= x.abs() * 2.0**-4 + 1e-30)[big].all()
    # Dequantizing is exact: fp32 holds every e4m3 value times a power of two.
    assert torch.equal(y.double(), q.double() * torch.pow(2.0, e.double() - 127)[..., None])
    # No value saturates: the scaled amax sits in [128, 256), under e4m3's 448.
    assert (q.float().abs().amax(-1) < 257).all() and (q.float().abs().amax(-1) >= 128).all()


# -- the torch backend (the CPU serving path) against the reference ---------------------

def test_torch_backend_stores_the_references_bytes():
    slots, k, v = _kv()
    want, got = _caches(), _caches()
    ref.store_kv(k, v, *want[:2], slots, *want[2:])
    TorchBackend().store_kv(k, v, *got[:2], slots, *got[2:])
    assert all(torch.equal(a, b) for a, b in zip(_bytes(got), _bytes(want), strict=True))
    assert int((want[2] > 0).sum()) == int((slots >= 0).sum()) * H  # every written head has a scale


def test_reference_attention_is_attention_over_the_dequantized_cache():
    """quantize -> store -> dequantize in the attention == the reference over fp32 caches
    holding the dequantized values (bit for bit: the same values meet the same math)."""
    kc, vc, ks, vs = _filled()
    deq_k, deq_v = dequantize(kc, ks), dequantize(ref.v_token_major(vc), vs)
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(2))
    got = ref.decode_attention(q, kc, vc, LENS, BT, 0.125, ks, vs)
    assert torch.equal(got, ref.decode_attention(q, deq_k, deq_v, LENS, BT, 0.125))


@pytest.mark.parametrize("op", ["decode", "prefill", "block"])
def test_torch_backend_attention_equals_the_reference_and_another_heads_scales_are_caught(op):
    kc, vc, ks, vs = _filled()
    gen = torch.Generator().manual_seed(3)
    kb, vb = torch.randn(2, 3, H, D, generator=gen), torch.randn(2, 3, H, D, generator=gen)
    backend = TorchBackend()

    def run(impl, k_scale, v_scale):
        if op == "decode":
            q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(4))
            return impl.decode_attention(q, kc, vc, LENS, BT, 0.125, k_scale=k_scale, v_scale=v_scale)
        if op == "prefill":
            q = torch.randn(25, 4, D, generator=torch.Generator().manual_seed(4))
            cu = torch.tensor([0, 5, 25], dtype=torch.int32)
            if impl is ref:
                return ref.prefill_attention(q, kc, vc, cu, LENS, BT, 0.125, k_scale, v_scale)
            return impl.prefill_attention(q, kc, vc, cu, LENS, BT, 0.125, k_scale=k_scale, v_scale=v_scale)
        q = torch.randn(2, 3, 4, D, generator=torch.Generator().manual_seed(4))
        return impl.block_attention(q, kb, vb, kc, vc, LENS, BT, 0.125, k_scale=k_scale, v_scale=v_scale)

    want = run(ref, ks, vs)
    torch.testing.assert_close(run(backend, ks, vs), want, rtol=1e-5, atol=1e-6)
    wrong = run(backend, _other_heads(ks), _other_heads(vs))
    assert (wrong - want).abs().max() > 1e-2


# -- the Triton kernels (interpreter on CPU) against the reference ----------------------

@pytest.mark.parametrize("seed,tokens,runs", [(0, None, False), (1, 32, False), (0, 2, False),
                                              (1, None, True), (2, 8, True), (3, 32, True)])
def test_triton_store_writes_the_references_bytes(seed, tokens, runs):
    """Any tokens a program (40 tokens: a partial last program), scattered slots or runs
    of consecutive ones (some crossing a page, one cut by a skipped slot), the same bytes."""
    slots, k, v = _kv(seed)
    if runs:
        slots = torch.cat([torch.arange(16, 40), torch.arange(100, 116)])
        slots[30] = -1
    want, got = _caches(), _caches(DEV)
    ref.store_kv(k, v, *want[:2], slots, *want[2:])
    store_kv(k.to(DEV), v.to(DEV), *got[:2], slots.to(DEV), *got[2:], fp8_tokens=tokens)
    assert all(torch.equal(a, b) for a, b in zip(_bytes(got), _bytes(want), strict=True))


def test_triton_store_bf16_input_writes_the_references_bytes():
    slots, k, v = _kv(2)
    k, v = k.bfloat16(), v.bfloat16()
    want, got = _caches(), _caches(DEV)
    ref.store_kv(k, v, *want[:2], slots, *want[2:])
    store_kv(k.to(DEV), v.to(DEV), *got[:2], slots.to(DEV), *got[2:])
    assert all(torch.equal(a, b) for a, b in zip(_bytes(got), _bytes(want), strict=True))


def _nonfinite_kv(seed=5):
    """_kv's rows with a NaN, a +inf and a -inf planted in some token-heads of K and V."""
    slots, k, v = _kv(seed)
    k[4, 0, 7], k[9, 1, 0], v[4, 1, 3], v[20, 0, 63] = float("nan"), float("inf"), -float("inf"), float("nan")
    return slots, k, v


def _no_nan_bytes(cache):
    return not ((cache.view(torch.uint8) & 0x7F) == 0x7F).any()  # e4m3fn's NaNs: 0x7F, 0xFF


def test_a_nonfinite_row_is_stored_as_zeros_under_an_infinite_scale():
    """A row with a NaN or inf leaves no e4m3 NaN in the cache (a kernel may read stale
    slots past a context unmasked) and stays visible in context: the torch backend, the
    reference and the Triton write agree on its bytes, and its dequantized row is NaN."""
    slots, k, v = _nonfinite_kv()
    want, got, kern = _caches(), _caches(), _caches(DEV)
    ref.store_kv(k, v, *want[:2], slots, *want[2:])
    TorchBackend().store_kv(k, v, *got[:2], slots, *got[2:])
    store_kv(k.to(DEV), v.to(DEV), *kern[:2], slots.to(DEV), *kern[2:])
    for other in (got, kern):
        assert all(torch.equal(a, b) for a, b in zip(_bytes(other), _bytes(want), strict=True))
    assert _no_nan_bytes(want[0]) and _no_nan_bytes(want[1])
    planted = {(0, 4, 0), (0, 9, 1), (1, 4, 1), (1, 20, 0)}  # (K or V, token, head)
    values = (want[0], ref.v_token_major(want[1]))  # V's head pages are stored transposed
    for field in (0, 1):
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            b, r = divmod(slot, PPB * PAGE)
            for h in range(H):
                at = (b, r // PAGE, h, r % PAGE)
                data, scale = values[field][at], int(want[2 + field][at])
                if (field, i, h) in planted:
                    assert scale == 255 and not data.float().any()
                    assert dequantize(data[None], torch.tensor([scale], dtype=torch.uint8)).isnan().all()
                else:  # every other row exactly as quantized alone
                    q, e = quantize((k, v)[field][i, h][None])
                    assert scale == int(e) and torch.equal(data.view(torch.uint8), q[0].view(torch.uint8))


def test_a_nonfinite_row_in_context_poisons_only_its_own_sequence():
    kc, vc, ks, vs = _filled()
    # sequence 0's token 5, head 1: a NaN V written through the writer
    ref.store_kv(torch.randn(1, H, D), torch.full((1, H, D), float("nan")), kc, vc,
                 torch.tensor([int(BT[0, 0]) * PPB * PAGE + 5]), ks, vs)
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(2))
    got = decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), LENS.to(DEV), BT.to(DEV), 0.125,
                           ks.to(DEV), vs.to(DEV)).cpu()
    assert got[0].isnan().all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("splits", [1, 2])
def test_triton_decode_equals_the_reference_and_catches_another_heads_scales(splits):
    """Scales on score/p columns, read a page row at a time (tiles of 128 span pages of 16,
    so rows of the scale read cross pages)."""
    kc, vc, ks, vs = (c.to(DEV) for c in _filled())
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(5)).to(DEV)
    bt, lens = BT.to(DEV), LENS.to(DEV)
    want = ref.decode_attention(q.cpu(), *(c.cpu() for c in (kc, vc)), LENS, BT, 0.125, ks.cpu(), vs.cpu())
    got = decode_attention(q, kc, vc, lens, bt, 0.125, ks, vs, num_splits=splits)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    wrong = decode_attention(q, kc, vc, lens, bt, 0.125, _other_heads(ks).contiguous(),
                             _other_heads(vs).contiguous(), num_splits=splits)
    assert (wrong.cpu() - want).abs().max() > 1e-2


@pytest.mark.parametrize("splits,v_pages,block_n", [(1, True, None), (2, True, None), (1, False, None),
                                                    (1, True, 16), (2, True, 16)])
def test_fp8_decode_reads_scales_ahead_across_many_tiles(splits, v_pages, block_n):
    """The decode reads each tile's scales a tile ahead and their blocks two ahead:
    contexts of several 128-token tiles over shuffled 32-token blocks (page 16), a context
    ending mid-tile and one of a single token, equal the reference; K and V read per page
    ([pages, D, page], the default), one page a tile (``block_n`` = page: the default at
    page 128) or per tile of tokens (``v_pages=False``)."""
    nb, h, page, ppb, d = 40, 2, 16, 2, 64
    gen = torch.Generator().manual_seed(9)
    n = nb * ppb * page
    caches = [torch.zeros(nb, ppb, h, page, dd, dtype=t) for t, dd in ((FP8, d), (FP8, d), (torch.uint8, 1),
                                                                         (torch.uint8, 1))]
    k = torch.randn(n, h, d, generator=gen) * torch.tensor([2.0, 0.3])[None, :, None]
    v = torch.randn(n, h, d, generator=gen)
    ref.store_kv(k, v, *caches[:2], torch.arange(n), *caches[2:])
    kc, vc, ks, vs = (c.to(DEV) for c in caches)
    bt = torch.randperm(nb, generator=gen)[:36].view(3, 12).int()
    lens = torch.tensor([384, 301, 1], dtype=torch.int32)
    q = torch.randn(3, 4, d, generator=gen)
    want = ref.decode_attention(q, kc.cpu(), vc.cpu(), lens, bt, 0.125, ks.cpu(), vs.cpu())
    got = decode_attention(q.to(DEV), kc, vc, lens.to(DEV), bt.to(DEV), 0.125, ks, vs, num_splits=splits,
                           v_pages=v_pages, block_n=block_n)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_fp8_decode_reads_pages_no_longer_than_its_tile_a_page_at_a_time():
    """The launcher's rule: an fp8 decode reads K and V a page at a time at pages shorter
    than its tile and at pages as long (one page a tile, three stages: page 128's default,
    bench/KERNEL_NOTES.md row 54); the DSpark block pass (extra tokens) only at shorter pages,
    16-bit caches never."""
    from pdflow.kernels.decode_attention import decode_tiles

    def tiles(page, nx=0, quant=True, **kw):
        return decode_tiles(quant=quant, page=page, block_m=16 if nx == 0 else 32, nx=nx, itemsize=2,
                            cuda=True, **kw)

    assert (tiles(16).v_pages, tiles(16).num_warps, tiles(16).num_stages) == (True, 2, 2)
    assert (tiles(128).v_pages, tiles(128).num_warps, tiles(128).num_stages) == (True, 2, 3)
    assert not tiles(128, v_pages=False).v_pages and tiles(128, v_pages=False).num_warps == 4
    assert not tiles(256).v_pages  # a page longer than the tile: K per token
    assert tiles(16, nx=8).v_pages and not tiles(128, nx=8).v_pages
    assert not tiles(16, quant=False).v_pages


def test_fp8_v_is_stored_in_transposed_head_pages():
    """Token ``t`` of head ``h`` of an fp8 V cache is column ``t`` of its head page
    ([D, page]); K stays [page, D]. The torch backend and the Triton write store the same
    bytes (tests above), so this pins the layout every reader assumes."""
    slots, k, v = _kv()
    kc, vc, ks, vs = _caches()
    ref.store_kv(k, v, kc, vc, slots, ks, vs)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, r = divmod(slot, PPB * PAGE)
        for h in range(H):
            at = (b, r // PAGE, h)
            qk, _ = quantize(k[i, h][None])
            qv, _ = quantize(v[i, h][None])
            assert torch.equal(kc.view(torch.uint8)[at][r % PAGE], qk[0].view(torch.uint8))
            assert torch.equal(ref.v_pages(vc)[at][:, r % PAGE], qv[0].view(torch.uint8))


def _transposed_v_decode(splits, dtype, dev):
    """Every slot first holds a stale row written by the writer (NaN and inf rows among
    them, as a block's earlier owner may leave), then the contexts are written over; the
    decode reads V's transposed head pages unmasked, stale slots past each context too."""
    nb, h, page, ppb, d = 40, 2, 16, 2, 64
    gen = torch.Generator().manual_seed(11)
    bt = torch.randperm(nb, generator=gen)[:36].view(3, 12).int()
    lens = torch.tensor([384, 301, 1], dtype=torch.int32)
    caches = [torch.zeros(nb, ppb, h, page, dd, dtype=t, device=dev)
              for t, dd in ((FP8, d), (FP8, d), (torch.uint8, 1), (torch.uint8, 1))]
    every = torch.arange(nb * ppb * page)
    stale_k, stale_v = (torch.randn(len(every), h, d, generator=gen) * 1e4 for _ in range(2))
    stale_v[::3, 0, 5], stale_v[1::3, 1, 0] = float("nan"), float("inf")
    write = store_kv if dev == "cuda" else ref.store_kv  # the interpreter's writes are slow; equal bytes
    write(stale_k.to(dev), stale_v.to(dev), *caches[:2], every.to(dev), *caches[2:])
    slots = torch.cat([bt[b].long().repeat_interleave(ppb * page)[:n] * ppb * page
                       + torch.arange(n) % (ppb * page) for b, n in enumerate(lens.tolist())])
    k = torch.randn(len(slots), h, d, generator=gen) * torch.tensor([2.0, 0.3])[None, :, None]
    v = torch.randn(len(slots), h, d, generator=gen)
    write(k.to(dev), v.to(dev), *caches[:2], slots.to(dev), *caches[2:])
    kc, vc, ks, vs = (c.cpu() for c in caches)
    assert _no_nan_bytes(vc)
    q = torch.randn(3, 4, d, generator=gen).to(dtype)
    want = ref.decode_attention(q.double(), kc, vc, lens, bt, 0.125, ks, vs)
    args = (q.to(dev), kc.to(dev), vc.to(dev), lens.to(dev), bt.to(dev), 0.125, ks.to(dev), vs.to(dev))
    got = decode_attention(*args, num_splits=splits)
    assert torch.isfinite(got).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    # V's bytes laid out token-major (as K's) are another layout's to the kernel: far off
    wrong = decode_attention(*args[:2], ref.v_token_major(vc).to(dev), *args[3:], num_splits=splits)
    assert not torch.allclose(wrong.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("splits,dtype", [(1, torch.float32), (2, torch.float32), (1, torch.bfloat16)])
def test_fp8_decode_reads_transposed_v_pages_over_stale_rows(splits, dtype):
    """V's head pages stored [D, page], over shuffled blocks, contexts ending mid-page and
    mid-tile, its V loads unmasked by token over stale rows; a token-major V is caught."""
    _transposed_v_decode(splits, dtype, DEV)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_fp8_decode_reads_a_transposed_v_cache_over_stale_nonfinite_rows(splits):
    """On the GPU an e4m3 NaN byte past a context would turn p = 0 into NaN (the
    interpreter reads 0x7F as 480): the writer's zeros-under-inf-scale rows keep it finite."""
    _transposed_v_decode(splits, torch.bfloat16, "cuda")


def test_fp8_decode_with_a_bf16_query():
    """A bf16 q (the GPU's dtype; the dots then run in fp16, where e4m3 and bf16 values
    are exact) stays within bf16's rounding of the reference; another head's scales are
    caught."""
    kc, vc, ks, vs = (c.to(DEV) for c in _filled())
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(8)).bfloat16()
    want = ref.decode_attention(q.double(), *(c.cpu() for c in (kc, vc)), LENS, BT, 0.125, ks.cpu(), vs.cpu())
    args = (q.to(DEV), kc, vc, LENS.to(DEV), BT.to(DEV), 0.125)
    got = decode_attention(*args, ks, vs)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)
    wrong = decode_attention(*args, _other_heads(ks).contiguous(), _other_heads(vs).contiguous())
    assert (wrong.cpu().double() - want).abs().max() > 5e-2


def test_triton_block_attention_equals_the_reference():
    kc, vc, ks, vs = (c.to(DEV) for c in _filled())
    gen = torch.Generator().manual_seed(6)
    q, kb, vb = (torch.randn(*s, generator=gen).to(DEV) for s in ((2, 3, 4, D), (2, 3, H, D), (2, 3, H, D)))
    want = ref.block_attention(q.cpu(), kb.cpu(), vb.cpu(), kc.cpu(), vc.cpu(), LENS, BT, 0.125,
                               ks.cpu(), vs.cpu())
    got = block_attention(q, kb, vb, kc, vc, LENS.to(DEV), BT.to(DEV), 0.125, ks, vs)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_triton_prefill_equals_the_reference():
    kc, vc, ks, vs = (c.to(DEV) for c in _filled())
    q = torch.randn(25, 4, D, generator=torch.Generator().manual_seed(7)).to(DEV)
    cu = torch.tensor([0, 5, 25], dtype=torch.int32)
    want = ref.prefill_attention(q.cpu(), kc.cpu(), vc.cpu(), cu, LENS, BT, 0.125, ks.cpu(), vs.cpu())
    got = prefill_attention(q, kc, vc, cu.to(DEV), LENS.to(DEV), BT.to(DEV), 0.125, max_seqlen_q=20,
                            k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


# -- the graph: scale units, their cut, bytes per block, per-side dtypes -----------------

PD = ["prefill=pp4", "decode=tp4", "drafter=dspark"]


def _graph(*overrides):
    return build_graph(compose([*PD, *overrides]))


def test_fp8_units_carry_scale_units_cut_per_head_with_their_kv():
    g = _graph("model.kv_dtype=fp8_e4m3")
    assert not g.validate()
    rank = g.rank("decode", 1)
    units = {u.name: u for u in rank.units}
    ks = units["mha.e8m0_d1.k_scale.layer_3"]
    assert (ks.heads, ks.head_dim, ks.dtype) == (units["mha.fp8_e4m3_d64.k.layer_3"].heads, 1, "e8m0")
    assert "draft.e8m0_d1.v_scale.layer_0" in units
    # Every consumer scale unit is written, from the same head its KV comes from.
    for cut in g.cuts:
        for group in cut.groups:
            for src, dst in group.units:
                assert src == dst
    written = {dst for c in g.cuts for grp in c.groups for _, dst in grp.units}
    assert {u.name for r in g.consumer.ranks for u in r.units} <= written


def test_bytes_per_transferred_block_halve_against_bf16():
    """The plan: e4m3 is half of bf16, plus one scale byte per (token, head) of d64."""
    fp8, bf16 = _graph("model.kv_dtype=fp8_e4m3"), _graph("model.kv_dtype=bf16")
    assert fp8.transfer_bytes_per_block * 128 == bf16.transfer_bytes_per_block * (64 + 1)
    assert fp8.transfer_bytes_per_block / bf16.transfer_bytes_per_block < 0.51
    assert fp8.budgets["decode"].stages[0].bytes_per_block * 128 == \
        bf16.budgets["decode"].stages[0].bytes_per_block * 65


def test_a_kv_dtype_that_differs_per_side_is_refused_by_name():
    g = _graph("prefill.kv_dtype=fp8_e4m3", "decode.kv_dtype=bf16")
    assert Code.UNIT_MISMATCH_DTYPE in g.codes()
    refusal = next(r for r in g.validate() if r.code == Code.UNIT_MISMATCH_DTYPE)
    assert "fp8_e4m3 != bf16" in refusal.message and "kv_dtype" in refusal.fix
    assert not _graph("prefill.kv_dtype=fp8_e4m3", "decode.kv_dtype=fp8_e4m3").validate()


def test_the_forced_wrong_scale_cut_moves_only_the_scale_units_to_another_head():
    right = _graph("model.kv_dtype=fp8_e4m3")
    wrong = _graph("model.kv_dtype=fp8_e4m3", "transfer.force_wrong_scale_cut=true")

    def runs(g):
        return {(c.producer_rank, c.consumer_rank, dst): grp.runs
                for c in g.cuts for grp in c.groups for _, dst in grp.units}

    a, b = runs(right), runs(wrong)
    changed = {k[2].split(".")[2] for k in a if a[k] != b[k]}
    assert changed == {"k_scale", "v_scale"}
    assert right.transfer_bytes_per_block == wrong.transfer_bytes_per_block  # nothing else shows it


# -- GPU: realistic shapes, bf16 activations, both page layouts --------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,ppb", [(16, 8), (128, 1)])
def test_gpu_fp8_write_and_attention_equal_the_reference(page, ppb):
    """70,000 bf16 tokens (past CUDA's 65535 grid cap) of 8 heads x d128 written by the
    kernel: the reference's bytes exactly (the hardware's cast never sees an inexact
    value); decode (1 and 4 splits), DSpark block and prefill over them equal the
    reference within bf16's tolerance, and another head's scales are caught."""
    gen = torch.Generator().manual_seed(page)
    n, h_kv, h_q, d, bs = 70_000, 8, 32, 128, page * ppb
    nb = -(-n // bs)
    slots = torch.arange(nb * bs)[torch.randperm(nb * bs, generator=gen)][:n].cuda()
    spread = 2.0 ** torch.arange(h_kv)[None, :, None]  # heads of different scales
    k = (torch.randn(n, h_kv, d, generator=gen) * spread / 16).cuda().bfloat16()
    v = (torch.randn(n, h_kv, d, generator=gen) ** 3 / spread).cuda().bfloat16()
    want = [torch.zeros(nb, ppb, h_kv, page, dd, dtype=t, device="cuda")
            for t, dd in ((FP8, d), (FP8, d), (torch.uint8, 1), (torch.uint8, 1))]
    got = [c.clone() for c in want]
    ref.store_kv(k, v, *want[:2], slots, *want[2:])
    store_kv(k, v, *got[:2], slots, *got[2:])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    kc, vc, ks, vs = got
    lens = torch.tensor([8192, 1, 4099, 777, 3000], dtype=torch.int32, device="cuda")
    per = -(-8192 // bs)
    bt = torch.randperm(nb, generator=gen)[: 5 * per].view(5, per).int().cuda()
    q = torch.randn(5, h_q, d, generator=gen).cuda().bfloat16()
    want_d = ref.decode_attention(q.double(), kc, vc, lens, bt, d**-0.5, ks, vs)

    def rel(x, y):
        return float((x.double() - y.double()).norm() / y.double().norm())

    for splits in (1, 4):
        got_d = decode_attention(q, kc, vc, lens, bt, d**-0.5, ks, vs, num_splits=splits)
        assert rel(got_d, want_d) < 1e-2, splits
    wrong = decode_attention(q, kc, vc, lens, bt, d**-0.5, _other_heads(ks).contiguous(),
                             _other_heads(vs).contiguous())
    assert rel(wrong, want_d) > 5e-2
    qb = torch.randn(5, 4, h_q, d, generator=gen).cuda().bfloat16()
    xk, xv = (torch.randn(5, 4, h_kv, d, generator=gen).cuda().bfloat16() for _ in range(2))
    want_b = ref.block_attention(qb.double(), xk.double(), xv.double(), kc, vc, lens, bt, d**-0.5, ks, vs)
    assert rel(block_attention(qb, xk, xv, kc, vc, lens, bt, d**-0.5, ks, vs), want_b) < 1e-2
    qlens = [512, 1, 99, 777, 8]
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(qlens), h_q, d, generator=gen).cuda().bfloat16()
    want_p = ref.prefill_attention(qp.double(), kc, vc, cu, lens, bt, d**-0.5, ks, vs)
    got_p = prefill_attention(qp, kc, vc, cu, lens, bt, d**-0.5, max_seqlen_q=max(qlens), k_scale=ks, v_scale=vs)
    assert rel(got_p, want_p) < 1e-2


def test_a_gpu_pd_fp8_page_off_the_copy_word_is_refused_by_name():
    cuda = ["prefill.device=cuda", "decode.device=cuda", "drafter=none", "model.kv_dtype=fp8_e4m3"]
    refused = build_graph(compose([*PD[:2], *cuda, "prefill.kv_page_tokens=4", "decode.kv_page_tokens=4"]))
    assert Code.KV_SCALE_PAGE_UNALIGNED in refused.codes()
    assert Code.KV_SCALE_PAGE_UNALIGNED not in build_graph(compose([*PD[:2], *cuda])).codes()
    cpu = build_graph(compose([*PD[:2], "drafter=none", "model.kv_dtype=fp8_e4m3", "prefill.kv_page_tokens=4",
                               "decode.kv_page_tokens=4"]))
    assert Code.KV_SCALE_PAGE_UNALIGNED not in cpu.codes()  # CPU packs any size
