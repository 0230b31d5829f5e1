"""Triton DSpark block attention against kernels.reference (CPU: TRITON_INTERPRET)."""

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
from pdflow.kernels.block_attention import block_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


def _run(lens, kb, h_q, h_kv, d, page, ppb, dtype, device, **tuning):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, device)
    b = len(lens)
    q = T.randn(b, kb, h_q, d, dtype=dtype, device=device, seed=5)
    k_blk = T.randn(b, kb, h_kv, d, dtype=dtype, device=device, seed=6)
    v_blk = T.randn(b, kb, h_kv, d, dtype=dtype, device=device, seed=7)
    out = torch.full_like(q, float("nan"))
    got = block_attention(q, k_blk, v_blk, kc, vc, cl, bt, d**-0.5, out=out, **tuning)
    want = ref.block_attention(*T.as64(q, k_blk, v_blk, kc, vc), cl, bt, d**-0.5)
    assert torch.isfinite(got).all() and got.data_ptr() == out.data_ptr()
    err = T.rel_err(got, want)
    assert err < TOL[dtype], err
    return err


@pytest.mark.parametrize(
    "kb,h_q,h_kv,d,page,ppb,dtype,splits",
    [
        (7, 4, 1, 64, 16, 2, torch.float32, 1),
        (8, 8, 2, 64, 128, 1, torch.bfloat16, 3),
        (3, 2, 2, 128, 16, 1, torch.float32, 2),
        (4, 16, 2, 64, 16, 4, torch.float32, 1),
    ],
)
def test_block_matches_reference(kb, h_q, h_kv, d, page, ppb, dtype, splits):
    # The block tokens straddle tile edges: lengths that are not page multiples.
    _run([1, 30, 77], kb, h_q, h_kv, d, page, ppb, dtype, DEV, num_splits=splits, block_n=16)


def test_block_sees_every_block_position():
    """The check can fail: a causal block (a different op) must not match."""
    kc, vc, cl, bt = T.make_paged([20], 1, 32, 16, 1, torch.float32, DEV)
    q = T.randn(1, 4, 1, 32, dtype=torch.float32, device=DEV)
    kx = T.randn(1, 4, 1, 32, dtype=torch.float32, device=DEV, seed=2)
    got = block_attention(q, kx, kx, kc, vc, cl, bt, 0.3, block_n=16)
    # Position 0 alone: context plus only the first block token.
    first = block_attention(q[:, :1], kx[:, :1], kx[:, :1], kc, vc, cl, bt, 0.3, block_n=16)
    assert T.rel_err(got[:, :1], first) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,ppb", [(16, 8), (128, 1)])
def test_block_gpu_shapes(page, ppb):
    _run([8192, 100, 3001, 6000], 8, 32, 8, 128, page, ppb, torch.bfloat16, "cuda")
