"""`pdflow plan` as a user runs it: from another directory, exit codes, JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PDFLOW = [sys.executable, "-m", "pdflow.cli"]


def plan(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PDFLOW, "plan", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_plan_default_and_reference_experiment(tmp_path):
    default = plan(tmp_path)
    assert default.returncode == 0, default.stderr
    assert "allowed" in default.stdout and "Producer (prefill)" in default.stdout
    ref = plan(tmp_path, "+experiment=ref_pp4_tp4_dspark")
    assert ref.returncode == 0, ref.stderr
    assert "minimax-m3" in ref.stdout and "binds the pool" in ref.stdout
    assert list(tmp_path.iterdir()) == []  # plan writes nothing


def test_plan_refuses_eagle3_under_pp(tmp_path):
    out = plan(tmp_path, "prefill=pp4", "decode=tp4", "drafter=eagle3")
    assert out.returncode != 0
    assert "EAGLE3_UNDER_PP" in out.stdout + out.stderr


def test_plan_json(tmp_path):
    out = plan(tmp_path, "--json", "prefill=pp2")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["allowed"] is True
    assert len(data["producer"]["stages"]) == 2
    assert data["cuts"][0]["groups"][0]["runs"][0]["length"] > 0
    refused = plan(tmp_path, "--json", "decode.tp=3")
    assert refused.returncode != 0
    assert json.loads(refused.stdout)["refusals"][0]["code"] == "HEAD_CUT_NOT_DIVISIBLE"


@pytest.mark.slow
def test_plan_multirun_prints_one_plan_per_job(tmp_path):
    out = plan(tmp_path, "-m", "prefill=pp4,tp4", "drafter=eagle3,none")
    assert out.returncode != 0  # one of the four jobs (pp4 + eagle3) is refused
    assert out.stdout.count("allowed: no refusals") == 3
    assert "EAGLE3_UNDER_PP" in out.stdout + out.stderr
