"""scripts/bench_serve.py: its client processes per load (a client that is itself the
bottleneck measures the client, not the server), and a tiny end-to-end run through the
split server on CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_client_processes_follow_the_streams_and_the_cores():
    per = _module().client_procs_for
    assert per(1, cores=16) == 1
    assert per(8, cores=16) == 8            # one per stream while half the cores allow
    assert per(64, cores=16) == 8           # half the host's cores
    assert per(256, cores=16) == 16         # at least one per 16 streams
    assert per(8, cores=2) == 1             # a 2-core host keeps its cores for the server


def test_a_tiny_split_run_prints_both_sides_and_their_ratio():
    out = subprocess.run([sys.executable, str(SCRIPT), "--front", "split", "--requests", "4",
                          "--concurrency", "2", "--output-len", "3", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("offline") for line in lines)
    assert any(line.startswith("OpenAI API over HTTP") and "TTFT p50" in line for line in lines)
    assert any(line.startswith("ratio (API / offline):") for line in lines), out.stdout
    assert "token counts differ" not in out.stdout  # every request served, as many tokens as offline
