"""``pdflow plan --png FILE``: the run graph drawn to a PNG, one per job of a sweep; the
picture follows the layout (the same layout draws the same bytes, another layout not)."""

from __future__ import annotations

import subprocess
import sys

from pdflow import compose
from pdflow.graph import build_graph
from pdflow.graph.picture import write_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png(tmp_path, name: str, *overrides: str) -> bytes:
    path = tmp_path / name
    write_png(build_graph(compose(list(overrides))), path)
    return path.read_bytes()


def test_plan_png_per_sweep_job_and_refused_without_a_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pdflow.cli", "plan", "-m", "--png", "plan.png",
                          "prefill=pp2,tp2", "decode=tp2"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    pictures = [(tmp_path / f"plan-{i}.png").read_bytes() for i in (0, 1)]
    assert all(p.startswith(PNG_MAGIC) and len(p) > 10_000 for p in pictures)
    assert pictures[0] != pictures[1]
    bad = subprocess.run([sys.executable, "-m", "pdflow.cli", "plan", "--png"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--png needs a file name" in bad.stderr


def test_picture_follows_the_layout(tmp_path):
    pp2 = _png(tmp_path, "a.png", "prefill=pp2", "decode=tp2")
    assert pp2 == _png(tmp_path, "b.png", "prefill=pp2", "decode=tp2")  # deterministic
    assert pp2 != _png(tmp_path, "c.png", "prefill=pp2", "decode=tp4")  # heads per consumer rank
    assert pp2 != _png(tmp_path, "d.png", "prefill=pp2", "decode=tp2", "prefill.kv_page_tokens=8",
                       "decode.kv_page_tokens=8")  # runs per cut
    refused = _png(tmp_path, "e.png", "prefill=pp2", "drafter=eagle3")
    assert refused.startswith(PNG_MAGIC) and refused != _png(tmp_path, "f.png", "prefill=pp2")
