"""Prefill variants (TMA descriptors, tl.range pipelining, persistent, prescaled Q,
packed bf16x2 exp2, two row halves) against kernels.reference (CPU: TRITON_INTERPRET)."""

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
from kernel_bench import prefill_variants as PV  # noqa: E402
from pdflow.kernels._common import exp_mode  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)


def _case(lens, qlens, h_q, h_kv, d, page, ppb, dtype, out_err=None, **kw):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, dtype, DEV)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    q = T.randn(sum(qlens), h_q, d, dtype=dtype, device=DEV)
    out = torch.full_like(q, float("nan"))
    got = PV.prefill_attention_variant(q, kc, vc, cu, cl, bt, d**-0.5, out=out, **kw)
    want = ref.prefill_attention(*T.as64(q, kc, vc), cu, cl, bt, d**-0.5)
    assert torch.isfinite(got).all()
    err = T.rel_err(got, want)
    assert err < (1e-2 if dtype != torch.float32 else 1e-3), err
    if out_err is not None:
        out_err.append((err, got))
    return kc


@pytest.mark.parametrize("kv,page,ppb", [("ptr", 16, 2), ("tma", 16, 2), ("tma", 8, 4),
                                         ("tma2d", 32, 1), ("tma", 32, 1)])
def test_kv_paths_match_reference(kv, page, ppb):
    # Prefix hit (30 cached + 15 new), a full prompt and a 1-token verify; NaN past ends.
    kc = _case([45, 33, 20], [15, 33, 1], 4, 2, 32, page, ppb, torch.float32, kv=kv, **SMALL)
    want = "ptr" if kv == "ptr" or not PV.tma_supported() else kv
    assert PV.variant_kv_mode(kc, kv, SMALL["block_n"]) == want


@pytest.mark.parametrize("extra", [dict(persistent=True), dict(prescale=True),
                                   dict(loop_stages=2)])
def test_schedule_and_math_variants(extra):
    _case([40, 7], [40, 7], 6, 2, 32, 16, 1, torch.bfloat16, kv="tma", **SMALL, **extra)


# Round 4: the packed exp and the two row halves on every K/V path, GQA 3 (padded to 4,
# so padding rows sit in both halves); prefix hit, full prompt, 1-token verify.
@pytest.mark.parametrize("kv,page,ppb", [("tma2d", 16, 1), ("tma", 8, 2), ("ptr", 16, 1)])
@pytest.mark.parametrize("extra", [dict(exp="bf16x2"), dict(split=2),
                                   dict(split=2, exp="bf16x2", loop_stages=2)])
def test_round4_switches_match_reference(kv, page, ppb, extra):
    _case([45, 33, 20], [15, 33, 1], 6, 2, 32, page, ppb, torch.bfloat16, kv=kv, **SMALL,
          **extra)


def test_halves_are_exact_in_float32_and_persistent():
    # fp32 holds the halves to 1e-3 (any row mixed up between halves shows), and the
    # packed exp is ignored for fp32.
    _case([45, 33, 20], [15, 33, 1], 6, 2, 32, 16, 1, torch.float32, kv="tma2d", **SMALL,
          split=2, exp="bf16x2", persistent=True)


def test_packed_exp_changes_p_but_stays_accurate():
    e0, e1 = [], []
    _case([40], [40], 4, 2, 64, 16, 1, torch.bfloat16, e0, kv="tma2d", **SMALL)
    _case([40], [40], 4, 2, 64, 16, 1, torch.bfloat16, e1, kv="tma2d", **SMALL, exp="bf16x2")
    assert not torch.equal(e0[0][1], e1[0][1])  # the switch reached the kernel
    assert e1[0][0] < 5e-3, (e0[0][0], e1[0][0])  # bench check: 1e-2


def test_exp_mode_follows_q_dtype():
    assert [exp_mode("bf16x2", dt) for dt in (torch.bfloat16, torch.float16, torch.float32)] \
        == [1, 2, 0]
    assert exp_mode("exp2", torch.bfloat16) == 0


def test_tile_wider_than_block_falls_back_to_pointers():
    kc = _case([40], [40], 4, 2, 32, 8, 1, torch.float32, kv="tma", **SMALL)
    assert PV.variant_kv_mode(kc, "tma", 16) == "ptr"  # block 8 < tile 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv,extra", [
    ("ptr", {}), ("tma", {}), ("tma2d", {}),
    ("tma", dict(loop_stages=3, exp="bf16x2")),
    ("tma2d", dict(loop_stages=3, split=2, num_warps=4, block_n=64, exp="bf16x2")),
    ("tma", dict(loop_stages=3, split=2, num_warps=4, block_n=64)),
    ("tma2d", dict(loop_stages=3, split=2, exp="bf16x2")),  # 8 warps: spills, still right
])
def test_variants_on_gpu_realistic(kv, extra):
    page, ppb = (128, 1) if kv == "tma2d" else (16, 8)
    kw = {**dict(block_m=128, block_n=128, num_warps=8, num_stages=2), **extra}
    _case([1000, 300, 129], [1000, 44, 1], 32, 8, 128, page, ppb, torch.bfloat16, kv=kv, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in")
def test_prefill_only_dry_run_checks_then_times_every_variant(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from kernel_bench import sweep

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--dry-run", "--prefill-only", "--budget-s", "1e9", "--out",
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
