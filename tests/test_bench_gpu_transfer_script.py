"""The GPU transfer bench (table 1 of issue 16) runs end to end on CPU: three processes,
every transfer config's pairs (Gloo for ``nccl``, Mooncake staging for ``mooncake_tcp``),
and its "exact" column, the tests' head oracle on every consumer rank, says yes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_gpu_transfer.py")


def test_the_transfer_bench_moves_exact_heads_through_each_transfer():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--model", "tiny", "--tokens", "256", "--pages", "16",
         "--transfers", "nccl,mooncake_tcp", "--reps", "1"],
        capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "GPU0 -> rank" in line]
    assert {r.split("|")[1].strip() for r in rows} == {"nccl ramp 0", "mooncake_tcp"}
    assert len(rows) == 4 and all(r.rstrip(" |").endswith("yes") for r in rows), rows
    movers = {r.split("|")[5].strip() for r in rows}
    assert movers == {"gloo", "mooncake"}
