"""scripts/bench_spec_decode.py's speed table on CPU: each cell is the median of the
``--repeats`` timed runs of one warm instance, and the trace line says over what range."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_spec_decode.py"


def test_speed_table_reports_the_median_of_repeated_runs():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "2", "--layouts", "single", "--kinds", "dspark",
         "--batches", "1", "--speed-tokens", "8", "--device", "cpu", "--speed-only", "--repeats", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 1 |"))
    none_overlap, none_plain, dspark, ratio = (c.strip() for c in row.strip("|").split("|")[1:5])
    # the printed cells are rounded (rates to 0.1, the ratio to 0.01)
    assert abs(float(ratio.rstrip("x")) - float(dspark) / max(float(none_overlap), float(none_plain))) < 0.011
    spreads = re.findall(r"- batch 1 (\w+) \(median of 3: (\d+)-(\d+) tok/s\)", out.stdout)
    assert [kind for kind, *_ in spreads] == ["none", "none", "dspark"], out.stdout
    # each reported median lies inside the range of its own runs
    for (_, low, high), median in zip(spreads, (none_overlap, none_plain, dspark), strict=True):
        assert int(low) - 1 <= float(median) <= int(high) + 1
