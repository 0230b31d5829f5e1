"""Triton KV write against kernels.reference.store_kv (CPU: TRITON_INTERPRET)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.interpreter import use_interpreter_if_no_cuda  # noqa: E402

use_interpreter_if_no_cuda()
from pdflow.kernels.store_kv import store_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(n, h, d, page, ppb, nb, dtype, src_dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(nb * page * ppb, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.2] = -1
    k = torch.randn(n, h, d, generator=gen).to(src_dtype)
    v = torch.randn(n, h, d, generator=gen).to(src_dtype)
    shape = (nb, ppb, h, page, d)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(4)]
    ref.store_kv(k, v, caches[0], caches[1], slots)
    kc, vc = caches[2].to(device), caches[3].to(device)
    store_kv(k.to(device), v.to(device), kc, vc, slots.to(device))
    # Written slots equal the reference bit for bit (within one ulp when the write casts:
    # the interpreter truncates where the GPU rounds); skipped, unowned slots stay NaN.
    rtol = 0.0 if dtype == src_dtype else torch.finfo(dtype).eps
    for got, want in ((kc, caches[0]), (vc, caches[1])):
        assert torch.allclose(got.cpu().float(), want.float(), rtol=rtol, atol=0, equal_nan=True)
    written = int((~torch.isnan(kc.cpu().float())).sum())
    assert written == int((slots >= 0).sum()) * h * d


@pytest.mark.parametrize(
    "h,d,page,ppb,dtype,src_dtype",
    [
        (2, 64, 16, 4, torch.float32, torch.float32),
        (8, 128, 16, 8, torch.bfloat16, torch.bfloat16),
        (1, 64, 128, 1, torch.float16, torch.float32),
        (4, 128, 128, 1, torch.bfloat16, torch.float32),
        (3, 64, 16, 2, torch.float32, torch.float32),
    ],
)
def test_store_kv_matches_reference(h, d, page, ppb, dtype, src_dtype):
    _check(n=37, h=h, d=d, page=page, ppb=ppb, nb=5, dtype=dtype, src_dtype=src_dtype,
           device=DEV)


def test_store_kv_wrong_page_is_caught():
    """The check can fail: writing a page-16 cache as if its page were the block."""
    gen = torch.Generator().manual_seed(3)
    slots = torch.arange(40)
    k = torch.randn(40, 2, 16, generator=gen)
    want = torch.full((2, 2, 2, 16, 16), float("nan"))
    ref.store_kv(k, k, want, want.clone(), slots)
    got = torch.full((2, 1, 2, 32, 16), float("nan"), device=DEV)
    store_kv(k.to(DEV), k.to(DEV), got, got.clone(), slots.to(DEV))
    assert not torch.allclose(got.cpu().view(want.shape), want, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page,ppb", [(16, 8), (128, 1)])
def test_store_kv_gpu_large_batch(page, ppb):
    # 70,000 tokens: more than 65535 rows, so the token axis must sit on grid axis 0.
    _check(n=70_000, h=8, d=128, page=page, ppb=ppb, nb=70_000 // (page * ppb) + 8,
           dtype=torch.bfloat16, src_dtype=torch.bfloat16, device="cuda")
