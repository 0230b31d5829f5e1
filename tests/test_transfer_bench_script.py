"""scripts/bench_transfer.py runs end to end at tiny sizes over real Mooncake (TCP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transfer_kit import needs_mooncake

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_transfer.py"


@needs_mooncake
def test_dry_run_measures_every_case_and_prints_the_ratios(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    *rows, meta = json.loads((tmp_path / "rows.json").read_text())
    cases = {(r["shape"].split(":")[0], r["case"], r["path"]) for r in rows}
    for shape in ("small", "large"):
        assert (shape, "memcpy (in-process)", "-") in cases
        for case in ("whole-block", "head-cut page 128", "head-cut page 16"):
            assert {(shape, case, "direct"), (shape, case, "packed")} <= cases
    assert all(r["gbps"] > 0 and r["bytes"] > 0 for r in rows)
    page16 = [r for r in rows if r["case"] == "head-cut page 16"]
    assert all(r["runs_per_block"] == 8 * next(w["runs_per_block"] for w in rows
                                               if w["shape"] == r["shape"] and w["case"] == "whole-block")
               for r in page16)  # 8 pages of 16 tokens per 128-token block, per unit
    assert "threads" in meta
    tail = out.stdout[out.stdout.index("ratios"):]
    assert tail.count("head-cut page 16 packed / best whole-block") == 2
