"""scripts/bench_gpu_accuracy.py (issue 18's accuracy table) on CPU at the tiniest size: the
one-process row, a P/D PP2 -> TP2 DSpark row and the same with the page-ignorant draft cut
forced (tokens equal, acceptance lower: the table says "caught"), no block held, and the table logged to MLflow as a parent run with a child per row (a failed
row a FAILED child with its error)."""

from __future__ import annotations

import json
import shutil

import bench_gpu_accuracy  # scripts/ is on sys.path (conftest)
import bench_mlflow
import mlflow
import pytest

pytestmark = pytest.mark.slow


def _store(folder, template) -> str:
    """An empty MLflow store in ``folder`` (a copy of the session's migrated one)."""
    shutil.copy(template, folder / "mlflow.db")
    return f"sqlite:///{folder}/mlflow.db"


def _runs(uri: str):
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("pdflow-bench")
    return client.search_runs([exp.experiment_id])


def test_accuracy_rows_and_their_mlflow_runs(tmp_path, mlflow_template):
    uri = _store(tmp_path, mlflow_template)
    code = bench_gpu_accuracy.main(["--device", "cpu", "--gpus", "2", "--n", "2", "--per-depth", "1",
                                    "--max-tokens", "24", "--context-len", "300",
                                    "--rows", "P/D PP2->TP2 dspark,P/D PP2->TP2 dspark (page-ignorant draft cut)",
                                    "--mlflow", uri, "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())["results"]
    assert [r["name"] for r in rows] == ["one process", "P/D PP2->TP2 dspark",
                                         "P/D PP2->TP2 dspark (page-ignorant draft cut)"]
    one, pd, wrong = rows
    assert wrong["identical"] == wrong["requests"] and wrong["acceptance"] < pd["acceptance"]
    assert "caught (acceptance drops, outputs do not)" in (tmp_path / "accuracy.md").read_text()
    assert pd["identical"] == pd["requests"] == 2 + 5  # two problems, one fact at each of five depths
    assert one["acceptance"] is None and pd["acceptance"] > 0 and pd["tokens_per_forward"] > 1
    assert set(pd["needle"]) >= {"needle_accuracy", "needle_accuracy_depth_0.50"}
    assert pd["blocks_held_after"] == {"prefill": 0, "decode": 0}
    runs = {r.info.run_name: r for r in _runs(uri)}
    parent = runs.pop("accuracy PP2->TP2")
    assert set(runs) == {"one process", "P/D PP2->TP2 dspark", "P/D PP2->TP2 dspark (page-ignorant draft cut)"}
    child = runs["P/D PP2->TP2 dspark"]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id and child.info.status == "FINISHED"
    assert child.data.metrics["acceptance"] == pytest.approx(pd["acceptance"])
    assert child.data.metrics["arith.arith_strict"] == pd["arith"]["arith_strict"]


def test_a_failed_row_is_a_failed_child_run(tmp_path, mlflow_template):
    uri = _store(tmp_path, mlflow_template)
    bench_mlflow.log_table(uri, experiment="pdflow-bench", table="t", text="| table |", tags={},
                           rows=[dict(name="good", x=1.5, layout=[2, 2]), dict(name="bad", error="refused: X")])
    runs = {r.info.run_name: r for r in _runs(uri)}
    assert runs["good"].info.status == "FINISHED" and runs["good"].data.metrics["x"] == 1.5
    assert runs["good"].data.params["layout"] == "[2, 2]"
    assert runs["bad"].info.status == "FAILED" and "refused: X" in runs["bad"].data.tags["pdflow.error"]


def test_the_export_holds_every_run_with_its_numbers_and_tables(tmp_path, mlflow_template):
    import export_mlflow

    uri = _store(tmp_path, mlflow_template)
    bench_mlflow.log_table(uri, experiment="pdflow-bench", table="t", text="| the table |", tags={},
                           rows=[dict(name="a", x=2.0), dict(name="b", x=3.0)])
    assert export_mlflow.main(["--uri", uri, "--out", str(tmp_path / "runs.json")]) == 0
    runs = {r["name"]: r for r in json.loads((tmp_path / "runs.json").read_text())["runs"]}
    assert runs["t"]["artifacts"]["table.md"] == "| the table |"
    assert runs["a"]["metrics"] == {"x": 2.0} and runs["b"]["parent"] == runs["t"]["run_id"]
    assert json.loads(runs["b"]["artifacts"]["row.json"])["x"] == 3.0
