"""The batched ``torch`` backend equals the reference ops (the oracle) on random inputs."""

from __future__ import annotations

import os

import pytest
import torch
from pdflow.kernels import reference as ref

from pdflow.attention import cpu_decode, paged_plan
from pdflow.attention.backends import get_backend

D = 16
SCALE = 0.25
# (H_q, H_kv, page, block): GQA groups 1/2/4, page 16 inside 32-blocks and page == block.
GEOMETRIES = [(4, 4, 16, 32), (8, 4, 16, 32), (8, 2, 16, 16), (4, 1, 8, 8), (8, 4, 32, 32)]
GEO_IDS = [f"g{hq // hkv}-p{page}-b{bs}" for hq, hkv, page, bs in GEOMETRIES]




def require_cpu_op() -> None:
    """Skip unless the compiled CPU decode op built; under CI fail instead (CI has a
    compiler), unless PDFLOW_CPU_KERNELS=0 turned the op off."""
    if os.environ.get("PDFLOW_CPU_KERNELS", "1") == "0":
        pytest.skip("PDFLOW_CPU_KERNELS=0 turns the CPU decode op off")
    if cpu_decode.op() is not None:
        return
    why = "the CPU decode op (pdflow/attention/cpu_decode.py) did not build; its warning says why"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def make_cache(geo, num_blocks, dtype, gen):
    h_q, h_kv, page, bs = geo
    shape = (num_blocks, bs // page, h_kv, page, D)
    return (torch.randn(shape, generator=gen, dtype=dtype),
            torch.randn(shape, generator=gen, dtype=dtype))


def make_tables(ctx_lens, bs, num_blocks, gen, pad_width=1):
    """Disjoint random blocks per sequence, padded with 0 like the engine's tables."""
    need = [-(-c // bs) for c in ctx_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + pad_width
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used:used + n])
        used += n
    return tables


def close(got, want, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, want, **tol)


@pytest.fixture
def backend():
    return get_backend("torch")


@pytest.fixture(params=[1, 16, 10**9], ids=["all-long", "split", "all-padded"])
def long_chunk(request, monkeypatch):
    """Prefill attends long chunks one by one and pads short ones together: test every
    token through either path."""
    monkeypatch.setattr(paged_plan, "LONG_CHUNK", request.param)
    return request.param


@pytest.fixture(params=[True, False], ids=["fused", "gather"])
def fused(request, monkeypatch):
    """Decode runs the compiled CPU op (fp32) when it builds, else gather + matmuls."""
    if request.param:
        require_cpu_op()
    else:
        monkeypatch.setattr(cpu_decode, "usable", lambda *a: False)
    return request.param


def test_fused_decode_op_is_used_for_fp32(monkeypatch):
    require_cpu_op()
    q = torch.zeros(1, 4, 64)
    cache = torch.zeros(2, 2, 2, 16, 64)
    assert cpu_decode.usable(q, cache, cache)
    assert not cpu_decode.usable(q.double(), cache.double(), cache.double())
    assert not cpu_decode.usable(q, cache.transpose(0, 1), cache)


def test_the_fused_decode_op_refuses_metadata_that_does_not_match_its_tensors():
    """It reads pages through raw pointers: mismatched metadata once segfaulted (a prefill's
    rows given as decode rows); now each case raises, and the same call with matching
    metadata runs."""
    require_cpu_op()
    op = cpu_decode.op()
    q = torch.randn(2, 4, 64)
    kc, vc = torch.randn(3, 1, 2, 16, 64), torch.randn(3, 1, 2, 16, 64)
    lens = torch.tensor([5, 16], dtype=torch.int32)
    tables = torch.tensor([[0, 0], [2, 0]], dtype=torch.int32)
    assert op(q, kc, vc, lens, tables, 0.125).shape == q.shape
    bad = {
        "one new token per sequence": (q.repeat(3, 1, 1), lens, tables),  # a prefill's rows
        "table holds": (q, torch.tensor([5, 40], dtype=torch.int32), tables),
        "of a pool of 3": (q, lens, torch.tensor([[0, 0], [7, 0]], dtype=torch.int32)),
        "int32 lengths": (q, lens.long(), tables),
    }
    for match, (qq, ll, tt) in bad.items():
        with pytest.raises(RuntimeError, match=match):
            op(qq, kc, vc, ll, tt, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=GEO_IDS)
def test_decode_equals_reference(backend, geo, dtype, fused):
    gen = torch.Generator().manual_seed(hash(geo) % 1000)
    h_q, h_kv, page, bs = geo
    # Mixed lengths: 1, inside a page, exactly a page, not dividing the page, several blocks.
    ctx = [1, 5, page, page + 3, 2 * bs + 7, 3 * bs]
    kc, vc = make_cache(geo, 40, dtype, gen)
    tables = make_tables(ctx, bs, 40, gen)
    q = torch.randn(len(ctx), h_q, D, generator=gen, dtype=dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    got = backend.decode_attention(q, kc, vc, lens, tables, SCALE)
    want = ref.decode_attention(q, kc, vc, lens, tables, SCALE)
    close(got, want, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_fused_decode_head_dims(backend, head_dim):
    """The op has unrolled code for head_dim 64 and 128 and a generic loop for others."""
    require_cpu_op()
    gen = torch.Generator().manual_seed(head_dim)
    ctx = [1, 16, 33, 100]
    shape = (20, 2, 4, 16, head_dim)
    kc, vc = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = make_tables(ctx, 32, 20, gen)
    q = torch.randn(len(ctx), 8, head_dim, generator=gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    got = backend.decode_attention(q, kc, vc, lens, tables, head_dim**-0.5)
    close(got, ref.decode_attention(q, kc, vc, lens, tables, head_dim**-0.5), torch.float32)


def prefill_case(geo, qlens, ctx, dtype, seed, num_blocks=48):
    gen = torch.Generator().manual_seed(seed)
    h_q, h_kv, page, bs = geo
    kc, vc = make_cache(geo, num_blocks, dtype, gen)
    tables = make_tables(ctx, bs, num_blocks, gen)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h_q, D, generator=gen, dtype=dtype)
    return q, kc, vc, cu, torch.tensor(ctx, dtype=torch.int32), tables


PREFILL_CASES = {
    # whole prompts, lengths not dividing the page
    "prompts": ([7, 33, 1, 20], [7, 33, 1, 20]),
    # chunked prefill over a cached prefix (prefix-cache hit or earlier chunk)
    "cached-prefix": ([16, 9, 40], [48, 9, 75]),
    # k+1-token verify chunks (k = 3) next to plain decode rows
    "verify": ([4, 4, 1, 4], [21, 64, 30, 5]),
    # a sequence that computes nothing this step (q length 0)
    "empty-row": ([3, 0, 12], [19, 8, 12]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
@pytest.mark.parametrize("geo", GEOMETRIES, ids=GEO_IDS)
def test_prefill_equals_reference(backend, geo, case, dtype, long_chunk):
    qlens, ctx = PREFILL_CASES[case]
    args = prefill_case(geo, qlens, ctx, dtype, seed=len(case) + geo[0])
    got = backend.prefill_attention(*args, SCALE)
    want = ref.prefill_attention(*args, SCALE)
    close(got, want, dtype)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=GEO_IDS)
def test_store_kv_equals_reference(backend, geo):
    gen = torch.Generator().manual_seed(3)
    h_q, h_kv, page, bs = geo
    kc, vc = make_cache(geo, 6, torch.float32, gen)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([0, page - 1, -1, page, bs + 3, 6 * bs - 1, -1])
    k = torch.randn(len(slots), h_kv, D, generator=gen)
    v = torch.randn(len(slots), h_kv, D, generator=gen)
    backend.store_kv(k, v, kc, vc, slots)
    ref.store_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_stale_nan_slots_do_not_leak(backend, long_chunk, fused):
    """Slots past a sequence's length (tail of its last page, padded table entries) may
    hold anything; the reference never reads them and neither may the backend."""
    geo = (8, 4, 16, 32)
    gen = torch.Generator().manual_seed(5)
    kc, vc = make_cache(geo, 12, torch.float32, gen)
    ctx = [3, 17, 40]
    tables = make_tables(ctx, 32, 12, gen)
    for cache in (kc, vc):  # poison every slot outside the sequences' tokens
        keep = torch.zeros(cache.shape[:1] + cache.shape[1:4], dtype=torch.bool)
        for b, c in enumerate(ctx):
            for pos in range(c):
                blk = int(tables[b, pos // 32])
                keep[blk, (pos % 32) // 16, :, pos % 16] = True
        cache[~keep] = float("nan")
    lens = torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(3, 8, D, generator=gen)
    got = backend.decode_attention(q, kc, vc, lens, tables, SCALE)
    close(got, ref.decode_attention(q, kc, vc, lens, tables, SCALE), torch.float32)
    cu = torch.tensor([0, 3, 4, 25], dtype=torch.int32)
    q = torch.randn(25, 8, D, generator=gen)
    got = backend.prefill_attention(q, kc, vc, cu, lens, tables, SCALE)
    close(got, ref.prefill_attention(q, kc, vc, cu, lens, tables, SCALE), torch.float32)


def test_plans_are_rebuilt_for_new_metadata(backend):
    """Layers of one step share a plan; a new step (new tensors) must not reuse it."""
    geo = (8, 4, 16, 32)
    gen = torch.Generator().manual_seed(7)
    kc, vc = make_cache(geo, 20, torch.float32, gen)
    tables = make_tables([40, 9], 32, 20, gen)
    q = torch.randn(2, 8, D, generator=gen)
    for ctx in ([40, 9], [41, 10], [12, 3]):
        lens = torch.tensor(ctx, dtype=torch.int32)
        for _ in range(2):  # second call hits the memo
            got = backend.decode_attention(q, kc, vc, lens, tables, SCALE)
            close(got, ref.decode_attention(q, kc, vc, lens, tables, SCALE), torch.float32)


def test_bf16_cache_matches_reference(backend):
    gen = torch.Generator().manual_seed(9)
    geo = (8, 2, 16, 32)
    kc, vc = (c.bfloat16() for c in make_cache(geo, 16, torch.float32, gen))
    ctx = [30, 5]
    tables = make_tables(ctx, 32, 16, gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(2, 8, D, generator=gen).bfloat16()
    got = backend.decode_attention(q, kc, vc, lens, tables, SCALE)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref.decode_attention(q, kc, vc, lens, tables, SCALE))


def test_registry_returns_batched_backend():
    from pdflow.attention.torch_backend import TorchBackend

    b = get_backend("torch")
    assert isinstance(b, TorchBackend) and b.name == "torch"
    assert b.decode_attention is not ref.decode_attention
