"""Triton paged prefill attention against kernels.reference (CPU: TRITON_INTERPRET)."""

from __future__ import annotations

import os
from dataclasses import astuple

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from kernel_bench import paged_inputs as T  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.interpreter import use_interpreter_if_no_cuda  # noqa: E402

use_interpreter_if_no_cuda()
from pdflow.kernels._common import SMEM_BYTES_OTHER, SMEM_BYTES_SM90  # noqa: E402
from pdflow.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_tiles,
    tile_shared_memory,
)

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


@pytest.mark.parametrize("limit", [SMEM_BYTES_SM90, SMEM_BYTES_OTHER])
@pytest.mark.parametrize("itemsize", [4, 2], ids=["fp32", "16bit"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_picked_tiles_fit_shared_memory(limit, itemsize, d):
    tiles = prefill_tiles(itemsize, d, 4, limit)
    assert tile_shared_memory(tiles.block_m, tiles.block_n, d, tiles.num_stages, itemsize) <= limit
    assert tiles.block_m >= 16 and tiles.block_n >= 16 and tiles.num_stages >= 1


def test_tile_choice_keeps_the_fast_path_and_shrinks_only_when_needed():
    # (block_m, block_n, num_warps, num_stages); tuples, since other test modules reload
    # the kernel modules (a new PrefillTiles class each time).
    # 16-bit d128 on sm_90: the measured best, untouched.
    assert astuple(prefill_tiles(2, 128, 4, SMEM_BYTES_SM90)) == (128, 128, 8, 2)
    # fp32 d128 at those tiles needs more than sm_90 has (the GPU said 262144 > 232448).
    assert tile_shared_memory(128, 128, 128, 2, 4) > SMEM_BYTES_SM90
    assert astuple(prefill_tiles(4, 128, 4, SMEM_BYTES_SM90)) == (128, 64, 8, 2)
    # A GQA group wider than the shrunk tile still gets whole groups per tile.
    assert prefill_tiles(4, 256, 64, SMEM_BYTES_OTHER).block_m >= 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_fp32_d128_on_gpu():
    """fp32 at d128 and d256: the launcher's tiles fit the GPU's shared memory (the
    H200's default tiles would need 262144 > 232448 bytes at d128), and the result
    matches the float64 reference."""
    _run([1000, 300, 129], [1000, 44, 1], 32, 8, 128, 16, 8, torch.float32, "cuda")
    _run([700, 20], [700, 20], 16, 4, 256, 128, 1, torch.float32, "cuda")
