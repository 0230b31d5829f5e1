"""scripts/bench_moe.py runs end to end on CPU (interpreted, tiny shape): the kernel is
checked against its reference per token count and the table prints last."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_moe.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in")
def test_dry_run_checks_every_token_count(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--tp", "2", "--out",
                          str(tmp_path / "t.md")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in (tmp_path / "t.md").read_text().splitlines() if line.startswith("| dry |")]
    assert [int(r[1]) for r in rows] == [1, 5, 40]
    for r in rows:
        assert float(r[3]) < 0.05  # bf16 within a few ulps of the reference (outputs ~1)
        assert float(r[4]) > 0 and float(r[7]) > 0 and r[8] in ("memory", "compute")
    assert out.stdout.rstrip().endswith(" |")  # table last
