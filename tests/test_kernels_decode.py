"""Triton paged decode attention against kernels.reference (CPU: TRITON_INTERPRET)."""

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
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _run(lens, h_q, h_kv, d, page, ppb, dtype, device, **tuning):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, device)
    q = T.randn(len(lens), h_q, d, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, kc, vc, cl, bt, d**-0.5, out=out, **tuning)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    want = ref.decode_attention(*T.as64(q, kc, vc), cl, bt, d**-0.5)
    assert torch.isfinite(got).all()
    err = T.rel_err(got, want)
    assert err < TOL[dtype], err
    return err


def test_interpreter_is_on_without_cuda():
    from pdflow.kernels import decode_attention as mod

    if not torch.cuda.is_available():
        assert "Interpreted" in type(mod._paged_split_kernel).__name__


@pytest.mark.parametrize(
    "h_q,h_kv,d,page,ppb,dtype,splits",
    [
        (2, 2, 64, 16, 2, torch.float32, 1),  # group 1
        (4, 2, 64, 16, 2, torch.bfloat16, 3),  # group 2, split-K
        (8, 2, 128, 128, 1, torch.float32, 2),  # group 4, page 128
        (8, 1, 64, 16, 1, torch.bfloat16, 1),  # group 8
        (16, 2, 128, 16, 4, torch.float16, 4),  # group 8, 4 splits
        (6, 2, 64, 128, 1, torch.float32, 1),  # group 3: padded head rows
    ],
)
def test_decode_matches_reference(h_q, h_kv, d, page, ppb, dtype, splits):
    # Mixed lengths, none a multiple of the page; one a single token.
    _run([1, 45, 130, 77], h_q, h_kv, d, page, ppb, dtype, DEV, num_splits=splits, block_n=16)


def test_more_splits_than_tiles():
    """Splits that get no tokens (short sequences) must not disturb the merge."""
    _run([3, 20], 4, 2, 64, 16, 1, torch.float32, DEV, num_splits=5, block_n=16)


def test_decode_wrong_page_is_caught():
    """The check can fail: read a page-16 cache as if its page were the whole block."""
    kc, vc, cl, bt = T.make_paged([40, 29], 2, 32, 16, 2, torch.float32, DEV)
    q = T.randn(2, 4, 32, dtype=torch.float32, device=DEV)
    nb = kc.shape[0]
    bad = decode_attention(q, kc.view(nb, 1, 2, 32, 32), vc.view(nb, 1, 2, 32, 32), cl, bt,
                           0.2, block_n=16)
    want = ref.decode_attention(*T.as64(q, kc, vc), cl, bt, 0.2)
    assert not T.rel_err(bad, want) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,ppb", [(16, 8), (128, 1)])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_decode_gpu_llama_shapes(page, ppb, splits):
    lens = [8192, 1, 4099, 777, 3000, 8191, 128, 5000]
    _run(lens, 32, 8, 128, page, ppb, torch.bfloat16, "cuda", num_splits=splits)
