"""Triton paged prefill attention against kernels.reference (CPU: TRITON_INTERPRET)."""

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
from pdflow.kernels.prefill_attention import prefill_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _run(lens, qlens, h_q, h_kv, d, page, ppb, dtype, device, **tuning):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, device)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = T.randn(sum(qlens), h_q, d, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(q, kc, vc, cu.to(device), cl, bt, d**-0.5, out=out, **tuning)
    want = ref.prefill_attention(*T.as64(q, kc, vc), cu.to(device), cl, bt, d**-0.5)
    assert torch.isfinite(got).all() and got.data_ptr() == out.data_ptr()
    err = T.rel_err(got, want)
    assert err < TOL[dtype], err
    return err


@pytest.mark.parametrize(
    "h_q,h_kv,d,page,ppb,dtype",
    [
        (2, 2, 64, 16, 2, torch.float32),
        (4, 2, 64, 128, 1, torch.bfloat16),
        (8, 2, 128, 16, 1, torch.float32),
        (8, 1, 64, 16, 4, torch.float16),
    ],
)
def test_prefill_matches_reference(h_q, h_kv, d, page, ppb, dtype):
    # Full prompt, prefix-cache hit (chunk after a cached prefix), a 1-token chunk,
    # and a 4-token verify step; no length a page multiple.
    _run([45, 61, 20, 37], [45, 19, 1, 4], h_q, h_kv, d, page, ppb, dtype, DEV)


def test_prefill_odd_group_and_tiles():
    """Group 3 (padded head rows) and tiles wider than the chunk."""
    _run([33, 9], [33, 9], 6, 2, 64, 16, 1, torch.float32, DEV, block_m=64, block_n=32)


def test_prefill_causality_is_checked():
    """The check can fail: the same queries placed at the start of the context (as if
    the prefix were not cached) see fewer tokens and must not match."""
    kc, vc, cl, bt = T.make_paged([30], 1, 32, 16, 1, torch.float32, DEV)
    q = T.randn(10, 2, 32, dtype=torch.float32, device=DEV)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEV)
    got = prefill_attention(q, kc, vc, cu, cl, bt, 0.3)
    shifted = ref.prefill_attention(*T.as64(q, kc, vc), cu, cl - 20, bt, 0.3)
    assert T.rel_err(got, shifted) > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,ppb", [(16, 8), (128, 1)])
def test_prefill_gpu_shapes(page, ppb):
    lens = [4096, 3000, 1500, 777]
    _run(lens, [4096, 1000, 1500, 8], 32, 8, 128, page, ppb, torch.bfloat16, "cuda")
