"""MLflow tracking on a real sqlite store in a temp directory: URI resolution, params
within MLflow's limits, runs that always close with the right status."""

from __future__ import annotations

import os
import shutil

import pytest
from omegaconf import OmegaConf

from pdflow.spec import TrackingSpec
from pdflow.spec.load import compose_spec
from pdflow.tracking import store
from pdflow.tracking.compare import markdown, table, varying_groups
from pdflow.tracking.params import CUT, REDACTED, config_params, flatten, limits
from pdflow.tracking.run_logger import PARENT_ENV, PARENT_TAG, TrackedRun


def test_relative_sqlite_resolves_against_the_launch_dir_not_a_later_cwd(tmp_path, monkeypatch):
    uri = store.resolve_uri("sqlite:///runs/mlflow.db", tmp_path)
    assert uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert store.resolve_uri(uri, tmp_path / "elsewhere") == uri  # absolute stays
    assert store.resolve_uri("http://mlflow:5000", tmp_path) == "http://mlflow:5000"
    assert store.resolve_uri("file:./mlruns", tmp_path) == f"file://{tmp_path}/mlruns"
    monkeypatch.chdir(tmp_path)
    assert store.resolve_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    assert store.artifact_root(uri) == (tmp_path / "runs" / "mlartifacts").as_uri()


def test_params_are_flat_cut_to_mlflow_limits_and_unique():
    max_key, max_value = limits()
    long_a, long_b = "k" * 300 + "a", "k" * 300 + "b"
    tree = {"a": {"b": 1, "c": [1, 2], "d": None}, "v": "x" * (max_value + 50), long_a: 1, long_b: 2,
            "serve": {"api_key": "secret", "port": 1}}
    params = config_params(tree)
    assert params["a.b"] == "1" and params["a.c"] == "[1, 2]" and params["a.d"] == "null"
    assert len(params["v"]) == max_value and params["v"].endswith(CUT)
    long_keys = [k for k in params if k.startswith("kkk")]
    assert len(long_keys) == 2 and all(len(k) <= max_key for k in long_keys)
    assert params["serve.api_key"] == REDACTED and "secret" not in "".join(params.values())
    assert flatten({"x": {}}) == {"x": {}}


@pytest.fixture(scope="module")
def tracking(tmp_path_factory, mlflow_template):
    root = tmp_path_factory.mktemp("mlflow")
    shutil.copy(mlflow_template, root / "mlflow.db")
    spec = TrackingSpec(uri=f"sqlite:///{root}/mlflow.db", experiment="t")
    return spec, store.client(spec.uri)


def _run(client, run_id):
    return client.get_run(run_id)


def test_a_finished_run_has_params_tags_metrics_and_artifacts(tracking, monkeypatch):
    spec, client = tracking
    monkeypatch.delenv(PARENT_ENV, raising=False)
    cfg = compose_spec(["decode=tp1"])
    tree = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    with TrackedRun(spec, run_name="one", tags={"pdflow.command": "run"}) as run:
        run.log_config(tree, "model:\n  name: tiny\n")
        run.log_metrics({"ttft_mean_s": 0.25, "requests": 3})
        run.log_json("plan.json", {"allowed": True})
    got = _run(client, run.run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "one"
    assert got.data.params["decode.tp"] == "1" and got.data.params["model.name"] == "tiny"
    assert got.data.metrics == {"ttft_mean_s": 0.25, "requests": 3.0}
    assert got.data.tags["pdflow.command"] == "run" and "pdflow.hw.cpu_count" in got.data.tags
    assert PARENT_TAG not in got.data.tags
    assert {a.path for a in client.list_artifacts(run.run_id)} == {"config.yaml", "plan.json"}
    exp = client.get_experiment(got.info.experiment_id)
    assert exp.artifact_location == store.artifact_root(spec.uri)


def test_a_raising_job_marks_its_run_failed_and_reraises(tracking, monkeypatch):
    spec, client = tracking
    monkeypatch.setenv(PARENT_ENV, "parent123")
    with pytest.raises(ValueError, match="bad spec"), TrackedRun(spec, run_name="two") as run:
        raise ValueError("bad spec")
    got = _run(client, run.run_id)
    assert got.info.status == "FAILED" and got.info.end_time is not None
    assert got.data.tags["pdflow.error"] == "ValueError: bad spec"
    assert got.data.tags[PARENT_TAG] == "parent123"
    assert "error.txt" in {a.path for a in client.list_artifacts(run.run_id)}


def test_tracking_off_touches_no_store(tmp_path):
    spec = TrackingSpec(enabled=False, uri=f"sqlite:///{tmp_path}/never.db")
    with TrackedRun(spec, run_name="off") as run:
        run.log_metrics({"x": 1.0})
        run.log_text("a.txt", "a")
    assert run.run_id is None and not os.path.exists(tmp_path / "never.db")


def test_compare_table_labels_rows_by_the_groups_that_vary(tracking, monkeypatch):
    spec, client = tracking
    monkeypatch.delenv(PARENT_ENV, raising=False)
    ids = []
    for prefill, ttft in (("pp2", 0.5), ("tp2", 0.25)):
        tags = {"pdflow.choice.prefill": prefill, "pdflow.choice.decode": "tp1"}
        with TrackedRun(spec, run_name=prefill, tags=tags) as run:
            run.log_metrics({"ttft_mean_s": ttft})
        ids.append(run.run_id)
    runs = [client.get_run(i) for i in ids]
    assert varying_groups(runs) == ["prefill"]
    header, rows = table(runs, ["prefill"], ["ttft_mean_s", "absent"])
    assert header == ["prefill", "status", "ttft_mean_s", "absent"]
    assert rows == [["pp2", "FINISHED", "0.5", "-"], ["tp2", "FINISHED", "0.25", "-"]]
    assert markdown(header, rows).splitlines()[2] == "| pp2 | FINISHED | 0.5 | - |"


def _sweep_config(uri: str, job_name: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="pdflow.conf", version_base="1.3"):
        return compose(config_name="config", return_hydra_config=True,
                       overrides=[f"tracking.uri={uri}", "tracking.experiment=sweeps", f"hydra.job.name={job_name}"])


def test_sweep_callback_parent_finishes_when_every_child_did(tracking, monkeypatch):
    from pdflow.tracking.callback import JOB_NAME, MlflowSweepCallback

    spec, client = tracking
    monkeypatch.delenv(PARENT_ENV, raising=False)
    callback = MlflowSweepCallback()
    callback.on_multirun_start(config=_sweep_config(spec.uri, "plan"))
    assert PARENT_ENV not in os.environ  # not `pdflow run`: nothing logged

    cfg = _sweep_config(spec.uri, JOB_NAME)
    callback.on_multirun_start(config=cfg)
    parent_id = os.environ[PARENT_ENV]
    exp = client.get_experiment_by_name("sweeps")
    assert exp is not None and client.get_run(parent_id).info.status == "RUNNING"
    children = []
    for name in ("a", "b"):
        with TrackedRun(TrackingSpec(uri=spec.uri, experiment="sweeps"), run_name=name) as run:
            run.log_metrics({"x": 1.0})
        children.append(run.run_id)
    callback.on_multirun_end(config=cfg)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["pdflow.sweep.children"] == "2"
    assert all(client.get_run(c).data.tags[PARENT_TAG] == parent_id for c in children)
    assert PARENT_ENV not in os.environ
