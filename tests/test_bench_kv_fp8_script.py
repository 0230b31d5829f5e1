"""scripts/bench_kv_fp8.py's verdicts: the acceptance bounds (strict within 1 point,
acceptance within 2, retrieval unchanged, bytes per block at most 0.51 of bf16's) say
yes when met and NO when not. The script's runs themselves are minutes long (the
numbers it printed are in bench/RESULTS.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_kv_fp8 import parse_args, verdicts  # noqa: E402

BF16_PLAN = 1_310_720


def _row(strict, acceptance, retrieval, per_block):
    return dict(arith={"arith_strict": strict}, acceptance=acceptance, needle={"needle_accuracy": retrieval},
                counter_bytes_per_block=per_block, plan_bytes_per_block=per_block)


def test_met_bounds_say_yes():
    lines = verdicts(_row(0.50, 0.70, 0.8, 2_621_440), _row(0.495, 0.685, 0.8, 665_600), BF16_PLAN)
    assert all("NO" not in line for line in lines) and "0.5078" in lines[-1]


def test_each_missed_bound_says_no():
    base = _row(0.50, 0.70, 0.8, 2_621_440)
    assert "NO" in verdicts(base, _row(0.48, 0.70, 0.8, 665_600), BF16_PLAN)[0]
    assert "NO" in verdicts(base, _row(0.50, 0.67, 0.8, 665_600), BF16_PLAN)[1]
    assert "NO" in verdicts(base, _row(0.50, 0.70, 0.7, 665_600), BF16_PLAN)[2]
    assert "NO" in verdicts(base, _row(0.50, 0.70, 0.8, 1_310_720), BF16_PLAN)[3]


def test_transfer_defaults_by_device():
    assert parse_args(["--device", "cpu"]).transfer == "mooncake_tcp"
    assert parse_args(["--device", "cuda"]).transfer == "nccl"
