"""The deployment search: ``pdflow run -m +experiment=search_tiny`` under Hydra's Optuna
sweeper makes one MLflow parent with a child per trial, counts the trials the estimate
pruned, and logs the Pareto front on the parent (sqlite in a temp dir). The profile here
makes every step cost 100 s, so every trial is pruned before launch: the structure is
what is tested, in seconds. The front itself is tested on plain runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pdflow.bench.profile import MachineProfile
from pdflow.tracking.pareto import best_run, front, points

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")


def _run(name: str, **metrics) -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(run_name=name, run_id=name), data=SimpleNamespace(metrics=metrics, tags={}))


def test_pareto_front_keeps_the_undominated_and_best_is_goodput_per_device():
    runs = [
        _run("a", ttft_p99_s=1.0, output_tok_s_per_device=10.0, goodput_per_device=0.5),
        _run("b", ttft_p99_s=2.0, output_tok_s_per_device=30.0, goodput_per_device=0.9),
        _run("c", ttft_p99_s=3.0, output_tok_s_per_device=20.0, goodput_per_device=1.2),  # dominated by b
        _run("d", ttft_p99_s=0.5, output_tok_s_per_device=5.0),
        _run("pruned", goodput_per_device=0.0),  # never measured: not a point
    ]
    assert [p[0].info.run_name for p in front(points(runs))] == ["d", "a", "b"]
    best, metric = best_run(runs)
    assert best.info.run_name == "c" and metric == "goodput_per_device"


@pytest.mark.parametrize(("experiment", "jobs"), [("search_tiny", 3), ("grid_tiny", 8)])
def test_search_makes_one_parent_with_a_child_per_trial_and_counts_pruned(tmp_path, mlflow_template, experiment,
                                                                          jobs):
    """The Optuna search, and the hand grid it must beat (Hydra's basic sweeper): the same
    parent/child structure, every trial pruned by the estimate."""
    profile = MachineProfile(device="cpu", host="test", cores=2, gemm_flops_s=1e10, gemm_flops_s_one_thread=1e10,
                             mem_bytes_s=1e10, host_copy_bytes_s=1e9, transfer_bytes_s={"mooncake": 1e9, "gloo": 1e9},
                             transfer_latency_s={"mooncake": 1e-4, "gloo": 1e-4}, rank_message_s=1e-4,
                             step_overhead_s=100.0).save(tmp_path / "profile.json")
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)  # an empty store, migrated once per session (conftest)
    env = os.environ | {"PDFLOW_PROFILE": str(profile)}
    out = subprocess.run(
        [sys.executable, "-m", "pdflow.cli", "run", "-m", f"+experiment={experiment}",
         *(["hydra.sweeper.n_trials=3"] if experiment == "search_tiny" else []), f"tracking.uri=sqlite:///{db}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("pdflow").experiment_id
    parents = client.search_runs([exp], "tags.`pdflow.sweep` = 'true'")
    assert len(parents) == 1
    parent = parents[0]
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == jobs
    assert all("pdflow.pruned" in c.data.tags and "TTFT" in c.data.tags["pdflow.pruned"] for c in children)
    assert all(c.data.metrics["est_goodput_req_s"] == 0 for c in children)
    assert parent.data.tags["pdflow.sweep.pruned"] == str(jobs)
    assert client.get_run(parent.info.run_id).data.tags["pdflow.sweep.children"] == str(jobs)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"pareto.png", "comparison.md"} <= artifacts


def test_a_run_logs_the_estimate_beside_what_it_measured(tmp_path):
    from pdflow.graph import build_graph
    from pdflow.spec.load import compose_spec
    from pdflow.tracking.estimate_log import measured_extras, plan_run
    from pdflow.tracking.run_logger import TrackedRun

    profile = MachineProfile(device="cpu", host="test", cores=2, gemm_flops_s=1e10, gemm_flops_s_one_thread=1e10,
                             mem_bytes_s=1e10, host_copy_bytes_s=1e9, transfer_bytes_s={"mooncake": 1e9},
                             transfer_latency_s={"mooncake": 1e-4}, step_overhead_s=0.01).save(tmp_path / "p.json")
    graph = build_graph(compose_spec(["workload=serve", "workload.slo.ttft_s=60", "prefill=tp2", "decode=tp2",
                                      "drafter=none"]))
    planned = plan_run(TrackedRun(None, run_name="x"), graph, profile)
    assert planned.pruned is None and planned.devices == 4 and planned.estimate.goodput_req_s > 0
    extras = measured_extras(planned, {"goodput_req_s": 2.0, "output_throughput_tok_s": 40.0, "ttft_p50_s": 0.5})
    assert extras["goodput_per_device"] == 0.5 and extras["output_tok_s_per_device"] == 10.0
    assert extras["goodput_est_over_measured"] == pytest.approx(planned.estimate.goodput_req_s / 2.0)
    assert extras["ttft_est_over_measured"] == pytest.approx(planned.estimate.ttft_s[planned.estimate.input_len] / 0.5)


def _tree(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from pdflow.spec.load import CONFIG_MODULE, CONFIG_NAME

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return OmegaConf.to_container(compose(config_name=CONFIG_NAME, overrides=overrides), resolve=True)


def test_deployment_key_ignores_only_what_a_run_does_not_use():
    from pdflow.tracking.trial_cache import deployment_key

    def key(*overrides: str) -> str:
        return deployment_key(_tree(list(overrides)))

    # A monolithic run starts no prefill instance and moves no KV.
    assert key("mode=monolithic", "prefill=tp1") == key("mode=monolithic", "prefill=tp2", "transfer=nccl")
    assert key("mode=monolithic", "decode=tp1") != key("mode=monolithic", "decode=tp2")
    # Under P/D every side and the transfer matter; run names and tracking never do.
    assert key("prefill=tp1") != key("prefill=tp2")
    assert key("transfer=auto") != key("transfer=nccl")
    assert key("drafter=none") != key("drafter=dspark")
    assert key("name=a", "tracking.uri=sqlite:///a.db") == key("name=b", "tracking.uri=sqlite:///b.db")


def test_search_space_samples_pd_choices_for_pd_trials_only():
    """A monolithic trial carries no prefill, partition or transfer; a P/D trial with a TP
    prefill no partition; a PP prefill all three (a real Optuna study asking trials)."""
    import optuna
    from omegaconf import OmegaConf

    from pdflow.spec.search_space import PD_ONLY, PP_ONLY, pd_choices

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {"monolithic": 0, "tp": 0, "pp": 0}
    for _ in range(60):
        trial = study.ask()
        mode = trial.suggest_categorical("mode", ["pd", "monolithic"])
        pd_choices(OmegaConf.create({"mode": "pd"}), trial)
        if mode == "monolithic":
            assert set(trial.params) == {"mode"}
            seen["monolithic"] += 1
        elif trial.params["prefill"].startswith("pp"):
            assert set(trial.params) == {"mode", *PD_ONLY, *PP_ONLY}
            seen["pp"] += 1
        else:
            assert set(trial.params) == {"mode", *PD_ONLY}
            seen["tp"] += 1
        study.tell(trial, 0.0)
    assert all(seen.values()), seen
    # the mode fixed on the command line (a user attribute), or only in the config
    fixed = study.ask()
    fixed.set_user_attr("mode", "monolithic")
    pd_choices(OmegaConf.create({"mode": "pd"}), fixed)
    assert not fixed.params
    from_config = study.ask()
    pd_choices(OmegaConf.create({"mode": "pd"}), from_config)
    assert set(PD_ONLY) <= set(from_config.params)
    # a choice fixed on the command line is not sampled again (the sweeper refuses the
    # overlap), and a fixed PP prefill still brings the partition in
    pp = study.ask()
    pp.set_user_attr("prefill", "pp2")
    pd_choices(OmegaConf.create({"mode": "pd"}), pp)
    assert set(pp.params) == (set(PD_ONLY) - {"prefill"}) | set(PP_ONLY)


def test_a_sweep_runs_each_deployment_once(tmp_path, mlflow_template):
    """The hand grid made monolithic asks for 8 trials of 4 deployments (its prefill
    choices do not apply): 4 run (all pruned here), 4 are tagged duplicates of them and
    launch nothing; the parent counts both, and its comparison lists each deployment once."""
    profile = MachineProfile(device="cpu", host="test", cores=2, gemm_flops_s=1e10, gemm_flops_s_one_thread=1e10,
                             mem_bytes_s=1e10, host_copy_bytes_s=1e9, transfer_bytes_s={"gloo": 1e9},
                             transfer_latency_s={"gloo": 1e-4}, rank_message_s=1e-4,
                             step_overhead_s=100.0).save(tmp_path / "profile.json")
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)  # an empty store, migrated once per session (conftest)
    out = subprocess.run(
        [sys.executable, "-m", "pdflow.cli", "run", "-m", "+experiment=grid_tiny", "mode=monolithic",
         f"tracking.uri=sqlite:///{db}"],
        cwd=tmp_path, env=os.environ | {"PDFLOW_PROFILE": str(profile)}, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    from pdflow.tracking.trial_cache import DUPLICATE_TAG, KEY_TAG

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("pdflow").experiment_id
    parent = client.search_runs([exp], "tags.`pdflow.sweep` = 'true'")[0]
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_id = {c.info.run_id: c for c in children}
    firsts = [c for c in children if DUPLICATE_TAG not in c.data.tags]
    repeats = [c for c in children if DUPLICATE_TAG in c.data.tags]
    assert len(children) == 8 and len(firsts) == 4 and len(repeats) == 4
    assert len({c.data.tags[KEY_TAG] for c in firsts}) == 4
    for c in repeats:
        first = by_id[c.data.tags[DUPLICATE_TAG]]
        assert DUPLICATE_TAG not in first.data.tags and first.data.tags[KEY_TAG] == c.data.tags[KEY_TAG]
        assert c.data.tags["pdflow.pruned"] == first.data.tags["pdflow.pruned"]
        assert "est_goodput_req_s" not in c.data.metrics  # nothing planned or launched for it
    tags = client.get_run(parent.info.run_id).data.tags
    assert (tags["pdflow.sweep.duplicates"], tags["pdflow.sweep.pruned"], tags["pdflow.sweep.children"]) == ("4", "8", "8")
