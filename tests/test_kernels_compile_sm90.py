"""The kernels compile for sm_90 on a machine without a GPU, and their K/V loads are
software-pipelined (scripts/kernel_bench/aot_check.py); catches GPU-only compile errors
early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

AOT_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "kernel_bench" / "aot_check.py"


def test_kernels_compile_for_sm90_and_pipeline():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(AOT_CHECK)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    from pdflow.kernels.prefill_gluon import gluon_available

    assert out.stdout.count("ok  ") == 25 + 4 * gluon_available(), out.stdout  # 6 of them fp8 KV
    # The fp8 decode's K and V through cp.async at both page sizes, a page at a time (the
    # default) and per token (aot_check counts its byte loads: triton 3.6 once read V a byte
    # at a time through a helper call).
    for case in ("decode fp8 page16 v_pages", "decode fp8 page16 (", "decode fp8 page128 v_pages",
                 "decode fp8 page128 ("):
        assert f"ok   {case}" in out.stdout, out.stdout
    # The pointer prefill's launcher-picked tiles fit sm_90 for fp32 and wide heads.
    assert out.stdout.count("(picked tiles)") == 4 and "FAIL" not in out.stdout, out.stdout
    # The production TMA kernel in both descriptor layouts, not only the variants.
    assert "ok   prefill tma page16 (page boxes)" in out.stdout, out.stdout
    assert "ok   prefill tma page128 (row boxes)" in out.stdout, out.stdout
