"""The triton backend's prefill dispatch: the TMA kernel (the best measured setting) only where the
device and the cache allow it, the pointer kernel otherwise (CPU: TRITON_INTERPRET)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from kernel_bench import paged_inputs as T  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.interpreter import use_interpreter_if_no_cuda  # noqa: E402

use_interpreter_if_no_cuda()
from pdflow.kernels import prefill_auto as PA  # noqa: E402
from pdflow.kernels import prefill_gluon as PG  # noqa: E402
from pdflow.kernels import prefill_tma as PT  # noqa: E402
from pdflow.kernels.prefill_attention import prefill_attention as pointer_prefill  # noqa: E402

from pdflow.attention.backends import get_backend  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(lens, qlens, h_q, h_kv, d, page, ppb, dtype):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, DEV)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    q = T.randn(sum(qlens), h_q, d, dtype=dtype, device=DEV)
    return q, kc, vc, cu, cl, bt


def _check(args, d, tol=1e-2):
    got = PA.prefill_attention(*args, d**-0.5, out=torch.full_like(args[0], float("nan")))
    want = ref.prefill_attention(*T.as64(*args[:3]), *args[3:], d**-0.5)
    assert torch.isfinite(got).all()
    assert T.rel_err(got, want) < tol
    return got


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback")
def test_cpu_picks_the_pointer_kernel():
    assert get_backend("triton").prefill_attention is PA.prefill_attention
    args = _inputs([45, 33, 20], [15, 33, 1], 4, 2, 32, 16, 8, torch.bfloat16)
    assert not PA.uses_tma(args[0], args[1], args[2])
    got = _check(args, 32)
    want = pointer_prefill(*args, 32**-0.5)  # the same kernel, so the same bits
    assert torch.equal(got, want)


def test_predicate_on_a_pretend_hopper(monkeypatch):
    """What the predicate would say on a TMA device (no device needed), and that the TMA
    path it then takes gives the reference's answer through the dispatch."""
    if not PT.tma_supported():
        pytest.skip("no tensor descriptors in this triton")
    monkeypatch.setattr(PA, "interpreting", lambda q: False)
    monkeypatch.setattr(PA, "_has_tma", lambda dev: True)
    bf = _inputs([140, 20], [140, 20], 4, 2, 32, 16, 8, torch.bfloat16)  # 128-token blocks
    assert PA.uses_tma(*bf[:3])
    assert PT.tma_kv_mode(bf[1], bf[2]) == PT.PAGE_BOXES
    assert PA.uses_tma(*_inputs([20], [20], 4, 2, 32, 128, 1, torch.float16)[:3])
    assert not PA.uses_tma(*_inputs([20], [20], 4, 2, 32, 16, 8, torch.float32)[:3])
    assert not PA.uses_tma(*_inputs([20], [20], 4, 2, 32, 16, 2, torch.bfloat16)[:3])  # 32
    assert not PA.uses_tma(*_inputs([20], [20], 4, 2, 48, 16, 8, torch.bfloat16)[:3])  # d48
    calls = []
    monkeypatch.setattr(PA, "prefill_attention_tma",
                        lambda *a, **kw: calls.append(kw) or PT.prefill_attention_tma(*a, **kw))
    _check(bf, 32)
    assert len(calls) == 1 and set(calls[0]) == {"max_seqlen_q", "out"}  # the defaults


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,ppb", [(16, 8), (128, 1)])
def test_gpu_dispatch(page, ppb):
    hopper = torch.cuda.get_device_capability()[0] == 9 and PT.tma_supported()
    args = _inputs([1000, 300, 129], [1000, 44, 1], 32, 8, 128, page, ppb, torch.bfloat16)
    assert PA.uses_tma(*args[:3]) == hopper
    gluon = hopper and PG.gluon_available()  # page 16: eight TMA boxes a tile
    assert PA.kernel_for(*args[:3]) == ("gluon" if gluon else "tma" if hopper else "pointer")
    _check(args, 128)
    # 32-token blocks: no 128-token box, so the pointer kernel even on Hopper.
    small = _inputs([300, 40], [300, 1], 32, 8, 128, 16, 2, torch.bfloat16)
    assert not PA.uses_tma(*small[:3])
    assert PA.kernel_for(*small[:3]) == "pointer"
    _check(small, 128)


def test_cpu_never_picks_gluon():
    """Gluon has no interpreter: CPU tensors (and fp32 anywhere) go elsewhere."""
    args = _inputs([140], [140], 4, 2, 64, 128, 1, torch.bfloat16)
    if not torch.cuda.is_available():
        assert PA.kernel_for(*args[:3]) == "pointer"
    assert not PG.gluon_applies(args[0].float(), args[1].float(), args[2].float())


def test_a_gluon_failure_falls_back_once(monkeypatch):
    """A triton that cannot build the Gluon kernel costs speed, not the request: the call
    falls back with a warning, and later calls do not try Gluon again on that device."""
    args = _inputs([140, 20], [140, 20], 4, 2, 64, 128, 1, torch.bfloat16)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("no such gluon op")

    monkeypatch.setattr(PA, "gluon_applies", lambda q, k, v: True)
    monkeypatch.setattr(PA, "prefill_attention_gluon", broken)
    monkeypatch.setattr(PA, "_GLUON_BROKEN", set())
    with pytest.warns(RuntimeWarning, match="Gluon prefill failed"):
        _check(args, 64)
    assert PA.kernel_for(*args[:3]) != "gluon"
    _check(args, 64)
    assert calls == [1]


def test_the_gluon_work_order_sections_heads_only_past_l2():
    """``default_head_group``: all query heads (the plain heaviest-first order) while the
    step's K/V fit ``L2_KV_BYTES``; past that, sections of whole KV heads whose K/V fit
    (bf16 K and V of 32K tokens x d128 are 16 MiB a KV head: two a section)."""
    f = PG.default_head_group
    assert [f(32, 8, 128, t) for t in (1, 2048, 8192, 8193, 16384, 32768, 65536, 10**6)] == \
        [32, 32, 32, 16, 16, 8, 4, 4]
    assert [f(32, 8, 64, t) for t in (8192, 16384, 32768, 65536)] == [32, 32, 16, 8]
    for h_q, h_kv in ((32, 8), (8, 8), (16, 2), (24, 6), (12, 3)):
        for t in (1, 5000, 40000, 300000):
            hg = f(h_q, h_kv, 128, t)
            assert h_q % hg == 0 and hg % (h_q // h_kv) == 0, (h_q, h_kv, t, hg)
    assert f(12, 3, 128, 2048) == 12 and f(12, 3, 128, 32768) == 4  # 3 KV heads: all, or one
