"""The TMA prefill kernel (the one the triton backend runs on Hopper) against
kernels.reference on both descriptor layouts (CPU: TRITON_INTERPRET)."""

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
from pdflow.kernels import prefill_tma as PT  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(block_m=32, block_n=16, num_warps=4, num_stages=1, loop_stages=2)

pytestmark = pytest.mark.skipif(not PT.tma_supported(), reason="no tensor descriptors")


def _case(lens, qlens, h_q, h_kv, d, page, ppb, dtype, **kw):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, DEV)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    q = T.randn(sum(qlens), h_q, d, dtype=dtype, device=DEV)
    got = PT.prefill_attention_tma(q, kc, vc, cu, cl, bt, d**-0.5,
                                   out=torch.full_like(q, float("nan")), **kw)
    want = ref.prefill_attention(*T.as64(q, kc, vc), cu, cl, bt, d**-0.5)
    assert torch.isfinite(got).all()
    assert T.rel_err(got, want) < (1e-3 if dtype == torch.float32 else 1e-2)
    return kc, vc


@pytest.mark.parametrize("page,ppb,mode", [(16, 1, PT.ROW_BOXES), (8, 2, PT.PAGE_BOXES),
                                           (16, 2, PT.PAGE_BOXES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_box_layouts_match_reference(page, ppb, mode, dtype):
    # Prefix hit (30 cached + 15 new), a full prompt and a 1-token verify, GQA 3 (padded
    # to 4, so padding rows sit in both row halves); NaN past every context.
    kc, vc = _case([45, 33, 20], [15, 33, 1], 6, 2, 32, page, ppb, dtype, **SMALL)
    assert PT.tma_kv_mode(kc, vc, SMALL["block_n"]) == mode


def test_no_box_is_refused_not_misread():
    # 8-token blocks cannot hold a 16-token tile: the launcher says so instead of
    # reading the next block's tokens.
    kc, vc, cl, bt = T.make_paged([20], 2, 32, 8, 1, torch.float32, DEV)
    q = T.randn(20, 4, 32, dtype=torch.float32, device=DEV)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEV)
    assert PT.tma_kv_mode(kc, vc, 16) == 0
    with pytest.raises(ValueError, match="no TMA box"):
        PT.prefill_attention_tma(q, kc, vc, cu, cl, bt, 0.2, **SMALL)
