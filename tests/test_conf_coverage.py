"""Every option in conf/ through ``pdflow run``: each one this CPU can run composes and
serves a tiny workload (1 request, 4 tokens), the others are refused by name before
anything launches. Options are combined so a handful of commands cover them all, and
``test_every_conf_option_is_covered`` fails when an option is added without a run here.
"""

from __future__ import annotations

import shutil

import pytest
from test_cli_run import pdflow, runs_in

from pdflow.spec.load import group_choices

pytestmark = pytest.mark.slow

TINY = ["workload.num_requests=1", "workload.max_tokens=4", "workload.concurrency=1", "workload.k_shot=1",
        "workload.context_len=768", "workload.depths=[0.5]", "workload.prompt_tokens=16",
        "workload.input_len=[8,16]", "workload.output_len=[2,4]", "workload.trace=trace.jsonl",
        "workload.progress=false"]
HF_TINY = ["model=hf", "model.path=pdflow:assets/tiny"]
WORKLOADS = "accuracy,arith,default,multiturn,needle,prefill,replay,serve"

# name -> (pdflow run arguments, jobs it runs). Every job must serve without an error.
RUNS = {
    "workloads": (["-m", f"workload={WORKLOADS}", "prefill=tp1", "decode=tp1", "drafter=none",
                   "transfer=mooncake_tcp"], 8),
    "ref_accuracy": (["+experiment=ref_accuracy", "prefill=pp4-uneven", "decode=tp2", "drafter=dspark",
                      "transfer=nccl"], 1),
    "ref_prefill_cost": (["+experiment=ref_prefill_cost", "prefill=pp4", "decode=tp4", "drafter=eagle"], 1),
    "tp_prefills": (["-m", "prefill=pp2,tp2,tp4", "decode=tp1", "drafter=none", "tracking=off", *HF_TINY], 3),
    "tp8_eagle3": (["prefill=tp1", "decode=tp8", "drafter=eagle3", "workload=prefill", "tracking=off",
                    "transfer=cuda_ipc"], 1),
    "goodput": (["workload=serve_slo_tiny", "mode=monolithic", "decode=tp1", "drafter=none",
                 "workload.slo.max_probes=1"], 1),
}
# Options run by another test: the search and the hand grid are sweeps of many deployments
# (tests/test_search.py runs both, every trial pruned by the estimate).
ELSEWHERE = {"experiment": {"search_tiny", "grid_tiny"}}
# name -> (sweep arguments, jobs, refusal codes every job is tagged with). Nothing launches.
REFUSED = {
    "too_big_for_cpu": (["-m", "model=llama3-8b,qwen3-8b,qwen3-0.6b,minimax-m3,qwen3-30b-a3b"], 5, {"KV_POOL_EMPTY"}),
    "reference_hardware_and_rdma": (
        ["-m", "+experiment=ref_pp4_tp4_dspark,ref_pp4uneven_tp4_dspark,ref_tp4_tp4_dspark",
         "transfer=mooncake_rdma"], 3, {"DEVICE_UNAVAILABLE", "RDMA_UNAVAILABLE"}),
}
# Options a run gets without naming them (the config's defaults).
DEFAULTS = {"model": "tiny", "transfer": "auto", "tracking": "mlflow"}
TRACE = '{"arrival_s": 0.0, "prompt": "Question: Tom has 3 pens.", "max_tokens": 3}\n'


def _named(args: list[str]) -> dict[str, set[str]]:
    """The options each config group gets in a command's jobs (defaults included)."""
    chosen = {g: {o} for g, o in DEFAULTS.items()}
    for arg in args:
        key, _, value = arg.partition("=")
        group = key.lstrip("+")
        if value and group in group_choices():
            chosen[group] = set(value.split(","))
    return chosen


@pytest.fixture
def launch_dir(tmp_path, mlflow_template):
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    (tmp_path / "trace.jsonl").write_text(TRACE)
    return tmp_path


@pytest.mark.parametrize("name", sorted(RUNS))
def test_runnable_options_serve_a_tiny_workload(name, launch_dir):
    args, jobs = RUNS[name]
    done = pdflow(launch_dir, "run", *args, *TINY)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("pdflow run:") == jobs  # one results table per job
    if "tracking=off" in args:
        return
    client, runs = runs_in(launch_dir)
    served = [r for r in runs if r.data.tags.get("pdflow.sweep") != "true"]
    assert len(served) == jobs
    for run in served:
        assert run.info.status == "FINISHED", run.data.tags
        metrics = run.data.metrics
        assert metrics and all(v == 0 for k, v in metrics.items() if "error" in k), metrics
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"plan.png", "plan.json", "results.json"} <= artifacts


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_options_this_host_cannot_run_are_refused_by_name(name, launch_dir):
    args, jobs, codes = REFUSED[name]
    done = pdflow(launch_dir, "run", *args, *TINY, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "results" not in done.stdout.lower()  # nothing served
    _, runs = runs_in(launch_dir)
    children = [r for r in runs if r.data.tags.get("pdflow.sweep") != "true"]
    assert len(children) == jobs
    for run in children:
        assert run.info.status == "FAILED"
        assert set(run.data.tags["pdflow.refusals"].split(",")) == codes, run.data.tags


def test_every_conf_option_is_covered():
    """Each option of each group runs in RUNS or is refused in REFUSED."""
    covered: dict[str, set[str]] = {g: set(o) for g, o in ELSEWHERE.items()}
    for args in [a for a, _ in RUNS.values()] + [a for a, _, _ in REFUSED.values()]:
        for group, options in _named(args).items():
            covered.setdefault(group, set()).update(options)
    missing = {g: sorted(set(opts) - covered.get(g, set())) for g, opts in group_choices().items()}
    assert {g: m for g, m in missing.items() if m} == {}
