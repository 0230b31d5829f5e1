"""The exact-fp32 small-row linear (``kernels/small_m_linear.py``) against an fp64 oracle, on
CPU under TRITON_INTERPRET and on CUDA when there is one; and where ``model.layers.linear``
sends a product.

The bound is relative to torch's own fp32 GEMM on the same inputs: the kernel may sum in
another order, but a TF32 product (10-bit mantissas) is far worse and fails it (the GPU
test runs cuBLAS with TF32 allowed on the same inputs)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow.kernels.small_m_linear import (  # noqa: E402
    MAX_ROWS,
    ROW_CLASSES,
    row_class,
    small_m_linear,
    small_m_linear_reference,
    wins,
)

from pdflow.model import layers  # noqa: E402
from pdflow.model.layers import Linear, linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def gpu(test):
    """GPU-only: selected by ``pytest -m gpu``, skipped without a device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _bound(x, w, b) -> float:
    """Allowed max error: 8x torch fp32's own, floored at 8 ulps of the largest value."""
    ref = small_m_linear_reference(x, w, b)
    torch_err = (F.linear(x, w, b) - ref).abs().max().item()
    return 8 * max(torch_err, torch.finfo(torch.float32).eps * ref.abs().max().item())


@pytest.mark.parametrize("rows,n,k,bias", [(8, 1024, 256, False), (3, 100, 70, True), (16, 48, 512, True),
                                           (2, 17, 16, False), (1, 64, 33, True)])
def test_small_m_linear_matches_the_fp64_oracle(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(DEV)
    w = torch.randn(n, k, generator=g).to(DEV)
    b = torch.randn(n, generator=g).to(DEV) if bias else None
    out = small_m_linear(x, w, b)
    assert out.shape == (rows, n)
    assert (out - small_m_linear_reference(x, w, b)).abs().max().item() <= _bound(x, w, b)


def test_small_m_linear_takes_leading_dims_and_row_strides():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(2, 4, 96, generator=g).to(DEV)
    x = big[..., :80]  # rows with a stride past their width
    w = torch.randn(40, 96, generator=g).to(DEV)[:, :80].contiguous()
    out = small_m_linear(x, w)
    assert out.shape == (2, 4, 40)
    want = small_m_linear_reference(x.reshape(-1, 80), w).reshape(2, 4, 40)
    assert (out - want).abs().max().item() <= _bound(x.reshape(-1, 80), w, None)


def test_small_m_linear_refuses_more_rows_than_it_is_for():
    with pytest.raises(AssertionError, match="at most"):
        small_m_linear(torch.zeros(MAX_ROWS + 1, 16, device=DEV), torch.zeros(16, 16, device=DEV))


def test_linear_on_cpu_is_torch_bit_for_bit():
    """The CPU oracle tests (greedy tokens equal transformers') depend on it."""
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_the_linear_module_is_nn_linear_routed_through_linear():
    """Drafters' unsharded projections: same parameters and state dict as ``nn.Linear`` (their
    checkpoints load unchanged), the product ``linear``'s (so the bias is kept)."""
    torch.manual_seed(3)
    mine, theirs = Linear(24, 12, bias=True), torch.nn.Linear(24, 12, bias=True)
    theirs.load_state_dict(mine.state_dict())
    assert set(mine.state_dict()) == {"weight", "bias"}
    x = torch.randn(8, 24)
    assert torch.equal(mine(x), theirs(x))


@gpu
def test_a_tf32_product_would_be_caught():
    """The bound tells fp32 from TF32: cuBLAS with TF32 allowed fails it on the same inputs."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(8, 768, generator=g).cuda(), torch.randn(512, 768, generator=g).cuda()
    bound = _bound(x, w, None)
    assert (small_m_linear(x, w) - small_m_linear_reference(x, w)).abs().max().item() <= bound
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = F.linear(x.repeat(4, 1), w)[:8]  # 32 rows: cuBLAS's tensor-core path
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert (tf32 - small_m_linear_reference(x, w)).abs().max().item() > bound


def test_the_kernel_takes_the_shapes_cublas_was_slow_on_only():
    assert wins(8, 256, 768) and wins(2, 128, 256) and wins(16, 768, 256)
    assert not wins(1, 256, 256) and not wins(17, 256, 256)
    assert wins(8, 256, 1024) and not wins(8, 256, 1025)
    assert not wins(8, 1024, 256)


def test_the_warm_up_meets_every_row_class_of_each_product_met():
    """A request may bring any row count the warm-up's steps did not (a GPU test caught a
    kernel compiled inside a request): the warm-up runs each seen shape at every class."""
    assert {row_class(r) for r in ROW_CLASSES} == {row_class(r) for r in range(2, MAX_ROWS + 1)}
    # as warm_small_m_row_classes reads a tensor's device: with its index on a GPU
    key = (24, 40, 48, True, torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device(DEV))
    layers.SMALL_M_SHAPES.add(key)
    try:
        assert layers.warm_small_m_row_classes(torch.device(DEV)) >= 1
    finally:
        layers.SMALL_M_SHAPES.discard(key)


@gpu
def test_linear_sends_small_fp32_cuda_products_to_the_kernel_and_one_row_to_cublas():
    g = torch.Generator().manual_seed(13)
    w = torch.randn(256, 128, generator=g).cuda()
    x8 = torch.randn(8, 128, generator=g).cuda()
    assert torch.equal(linear(x8, w), small_m_linear(x8, w))
    x1 = x8[:1].contiguous()
    assert torch.equal(linear(x1, w), F.linear(x1, w))
    xb = x8.bfloat16()
    assert torch.equal(linear(xb, w.bfloat16()), F.linear(xb, w.bfloat16()))
