"""Round-3 prefill variants (kernels/prefill_ws.py: tutorial-form step, packed 16-bit
exp2, in-kernel descriptors, two 64-row halves) against kernels.reference on CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels import testing as T  # noqa: E402

T.use_interpreter_if_no_cuda()
from pdflow.kernels import prefill_ws as W  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(block_m=32, block_n=16, num_warps=4, num_stages=1, loop_stages=1)


def _case(lens, qlens, h_q, h_kv, d, page, ppb, dtype, tol=1e-2, **kw):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, DEV)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    q = T.randn(sum(qlens), h_q, d, dtype=dtype, device=DEV)
    out = torch.full_like(q, float("nan"))
    got = W.prefill_attention_ws(q, kc, vc, cu, cl, bt, d**-0.5, out=out, **{**SMALL, **kw})
    want = ref.prefill_attention(*T.as64(q, kc, vc), cu, cl, bt, d**-0.5)
    assert torch.isfinite(got).all()
    err = T.rel_err(got, want)
    assert err < tol, err
    return err


# Prefix hit (30 cached + 15 new), a full prompt, a 1-token verify; NaN past the ends.
LENS, QLENS = [45, 33, 20], [15, 33, 1]


@pytest.mark.parametrize("page,ppb", [(16, 1), (8, 2)])  # 2D row boxes; 4D page boxes
@pytest.mark.parametrize("extra", [{}, dict(split=2), dict(exp="bf16x2")])
def test_variants_match_reference(page, ppb, extra):
    # GQA 3 (padded to 4): padding rows in every tile must stay out of the output.
    _case(LENS, QLENS, 6, 2, 32, page, ppb, torch.bfloat16, **extra)


def test_float32_is_exact_and_device_descriptors():
    if not W._has_device_desc():
        pytest.skip("no tl.make_tensor_descriptor in this triton")
    assert _case(LENS, QLENS, 4, 2, 32, 16, 1, torch.float32, tol=1e-3, dev_desc=True,
                 exp="bf16x2") < 1e-3  # exp="bf16x2" is ignored for fp32


def test_packed_exp_costs_little_accuracy():
    # bf16 input rounding of s - m: the error grows but stays well inside the 1e-2 check.
    e0 = _case([40], [40], 4, 2, 64, 16, 1, torch.bfloat16)
    e1 = _case([40], [40], 4, 2, 64, 16, 1, torch.bfloat16, exp="bf16x2")
    assert e1 < 5e-3 and e1 > e0 * 0.5


def test_refuses_without_a_box():
    kc = T.make_paged([20], 2, 32, 8, 1, torch.float32, DEV)[0]
    assert W.ws_kv_mode(kc, 16) == "ptr"  # block of 8 tokens < tile of 16
    with pytest.raises(ValueError):
        _case([20], [20], 4, 2, 32, 8, 1, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [{}, dict(exp="bf16x2"), dict(dev_desc=True),
                                dict(dev_desc=True, warp_specialize=True),
                                dict(split=2, num_warps=4, block_n=64)])
@pytest.mark.parametrize("page,ppb", [(128, 1), (16, 8)])
def test_variants_on_gpu_realistic(kw, page, ppb):
    _case([1000, 300, 129], [1000, 44, 1], 32, 8, 128, page, ppb, torch.bfloat16,
          **{**dict(block_m=128, block_n=128, num_warps=8, num_stages=2, loop_stages=3), **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in")
def test_prefill_only_dry_run_checks_then_times_every_variant(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from pdflow.kernels import sweep

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--dry-run", "--prefill-only", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    checks = [c for c in res["checks"] if c["name"].startswith("prefill r4")]
    n = len(sweep.PREFILL_ROUND)
    assert len(checks) == 2 * n and all(c["ok"] for c in checks)
    assert any("split=2 exp=bf16x2" in c["name"] for c in checks[:4])  # round 4 leads
    timed = [r for r in res["rows"] if r["kernel"] == "r4 prefill" and "ms" in r]
    assert len(timed) == 2 * n + 2  # + one BEST row per page size
    assert {r["kernel"] for r in res["rows"]} == {"prefill sdpa causal", "prefill triton",
                                                  "r4 prefill"}
