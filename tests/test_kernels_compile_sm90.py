"""The kernels compile for sm_90 on a machine without a GPU, and their K/V loads are
software-pipelined (kernels/aot_check.py); catches GPU-only compile errors early."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_kernels_compile_for_sm90_and_pipeline():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "pdflow.kernels.aot_check"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    from pdflow.kernels.prefill_gluon import gluon_available

    assert out.stdout.count("ok  ") == 10 + gluon_available(), out.stdout
    assert out.stdout.count("(round 4)") == 2, out.stdout  # bf16x2 exp; two row halves
