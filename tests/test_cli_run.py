"""``pdflow run``, ``pdflow run -m``, ``pdflow compare`` and ``pdflow serve`` as a user
runs them: subprocesses in a temp directory, MLflow in that directory's sqlite store."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import proc_helpers
import pytest

from pdflow.tracking import store

pytestmark = pytest.mark.slow
# The served side is the decode instance: one process, a small workload.
CHEAP = ["decode=tp1", "workload=prefill", "workload.num_requests=2", "workload.prompt_tokens=8",
         "workload.concurrency=2"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
for _name in ("PDFLOW_MLFLOW_PARENT_RUN_ID", "PDFLOW_VERBOSE", "PDFLOW_ALL_METRICS", "MC_LOG_LEVEL"):
    ENV.pop(_name, None)
# A glog line (Mooncake's C++ logging): severity letter, MMDD, time, thread id.
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", re.MULTILINE)


@pytest.fixture
def launch_dir(tmp_path, mlflow_template):
    """Where pdflow is started: an empty MLflow store is already there (copied, not
    migrated again), as after an earlier run."""
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    return tmp_path


def pdflow(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdflow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def runs_in(cwd: Path):
    client = store.client(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pdflow")
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_run_replays_a_trace_and_logs_one_run_next_to_where_it_started(launch_dir):
    tmp_path = launch_dir
    (tmp_path / "trace.jsonl").write_text(
        '{"arrival_s": 0.0, "prompt": "Question: Tom has 3 pens.", "max_tokens": 2}\n'
        '{"arrival_s": 0.2, "prompt_tokens": 12}\n{"arrival_s": 0.1, "prompt": [1, 40, 41]}\n')
    done = pdflow(tmp_path, "run", "decode=tp1", "drafter=none", "workload=replay", "workload.trace=trace.jsonl",
                  "workload.max_tokens=3")
    assert done.returncode == 0, done.stderr[-3000:]
    # One row per workload, not a row per metric (MLflow keeps every metric, below).
    assert "pdflow run" in done.stdout and re.search(r"│ replay +│ +3 │ +0 │", done.stdout), done.stdout
    assert "ttft_mean_s" not in done.stdout and "KV blocks:" in done.stdout
    # P/D over Mooncake TCP: the engines' own glog lines stay quiet by default (-v: below).
    assert not GLOG_LINE.search(done.stdout + done.stderr), done.stderr[-3000:]
    client, runs = runs_in(tmp_path)
    (run,) = runs
    assert run.info.status == "FINISHED"
    assert run.data.metrics["requests"] == 3 and run.data.metrics["errors"] == 0
    assert run.data.metrics["output_tokens"] == 2 + 3 + 3  # max_tokens per line, else the workload's
    # Start-up, warm-up included, and the part of it spent compiling (before any request).
    assert run.data.metrics["startup_s"] >= run.data.metrics["compile_s"] > 0
    assert run.data.tags["pdflow.choice.workload"] == "replay" and run.data.params["decode.tp"] == "1"
    assert "workload.trace=trace.jsonl" in run.data.tags["pdflow.overrides"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "plan.json", "results.json", "results.md", "results.png"} <= artifacts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlartifacts", "mlflow.db", "trace.jsonl"]


def test_sweep_is_one_parent_with_a_child_per_job_and_compare_shows_them(launch_dir):
    """PP2 vs TP2 prefill, DSpark on and off: four jobs, one parent, a row each."""
    tmp_path = launch_dir
    done = pdflow(tmp_path, "run", "-m", "prefill=pp2,tp2", "drafter=dspark,none", *CHEAP)
    assert done.returncode == 0, done.stderr[-3000:]
    client, runs = runs_in(tmp_path)
    (parent,) = [r for r in runs if r.data.tags.get("pdflow.sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4 == len(runs) - 1
    by_job = {(c.data.tags["pdflow.choice.prefill"], c.data.tags["pdflow.choice.drafter"]): c for c in children}
    assert set(by_job) == {(p, d) for p in ("pp2", "tp2") for d in ("dspark", "none")}
    for child in children:
        assert child.info.status == "FINISHED" and child.data.metrics["requests"] == 2
    assert parent.info.status == "FINISHED" and parent.info.end_time is not None
    assert (parent.data.tags["pdflow.sweep.children"], parent.data.tags["pdflow.sweep.failed"]) == ("4", "0")
    assert "comparison.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}

    shown = pdflow(tmp_path, "compare", "--metrics", "requests,prompt_tokens,ttft_mean_s")
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.startswith("|")]
    assert lines[0] == "| drafter | prefill | status | requests | prompt_tokens | ttft_mean_s |"
    rows = sorted(line.strip("| ").split(" | ") for line in lines[2:])
    assert [r[:5] for r in rows] == [
        ["dspark", "pp2", "FINISHED", "2", "16"], ["dspark", "tp2", "FINISHED", "2", "16"],
        ["none", "pp2", "FINISHED", "2", "16"], ["none", "tp2", "FINISHED", "2", "16"]]
    assert all(float(r[5]) > 0 for r in rows)
    assert (tmp_path / "pdflow-compare.png").stat().st_size > 0


def test_a_failing_sweep_job_marks_its_child_failed_and_the_parent_still_closes(launch_dir):
    """EAGLE3 under a PP prefill is refused at plan time: both jobs fail, cheaply."""
    tmp_path = launch_dir
    done = pdflow(tmp_path, "run", "-m", "prefill=pp2,pp4", "drafter=eagle3", *CHEAP)
    assert done.returncode != 0 and "EAGLE3_UNDER_PP" in done.stderr
    _, runs = runs_in(tmp_path)
    (parent,) = [r for r in runs if r.data.tags.get("pdflow.sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2
    for child in children:
        assert child.info.status == "FAILED" and child.info.end_time is not None
        assert child.data.tags["pdflow.refusals"] == "EAGLE3_UNDER_PP"
    assert parent.info.status == "FAILED" and parent.info.end_time is not None
    assert (parent.data.tags["pdflow.sweep.children"], parent.data.tags["pdflow.sweep.failed"]) == ("2", "2")


def test_all_prints_every_metric_the_run_logs(launch_dir):
    done = pdflow(launch_dir, "run", "--all", "mode=monolithic", *CHEAP)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = runs_in(launch_dir)[1]
    assert len(run.data.metrics) > 15
    for name in run.data.metrics:
        assert re.search(rf"│ {name} +│", done.stdout), (name, done.stdout)


def test_serve_prints_its_url_answers_and_stops_cleanly_on_sigterm(tmp_path):
    """With -v: the P/D pair's Mooncake engines log their own lines (quiet by default,
    as the replay run above shows)."""
    proc = subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", "-v", "decode=tp1", "drafter=none",
                             "serve.port=0"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV)
    try:
        deadline, url, seen = time.monotonic() + 300, None, []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
            url = found and found.group(1)
        assert url, "".join(seen)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        kids = proc_helpers.children(proc.pid)
        assert len(kids) == 2, kids  # the engine core and one API front
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "pdflow serve: stopped" in out
    everything = "".join(seen) + out
    assert GLOG_LINE.search(everything) and "Local segment descriptor not found" in everything, everything[-3000:]
    assert not [c for c in kids if Path(f"/proc/{c}").exists()], "children left running after SIGTERM"
