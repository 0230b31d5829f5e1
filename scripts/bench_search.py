"""The CPU search acceptance as one command: the hand grid (``+experiment=grid_tiny``:
prefill=pp2,tp2 x decode=tp2,tp4 x drafter=dspark,none) and the Optuna search
(``+experiment=search_tiny``, >= 20 trials) on the same workload and SLOs, each one
MLflow parent in a fresh sqlite store; prints both bests (goodput per device, measured
the same way), the search's trial, pruned and failed counts, and the ratio.

  pdflow profile && python scripts/bench_search.py [--trials 24] [--store DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def sweep(experiment: str, store: Path, extra: list[str]) -> str:
    """Runs the sweep; returns its parent run id."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "pdflow.cli", "run", "-m", f"+experiment={experiment}", f"tracking.uri={uri}",
           *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=store, check=False)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("pdflow").experiment_id
    parents = client.search_runs([exp], "tags.`pdflow.sweep` = 'true'", order_by=["attributes.start_time DESC"])
    return parents[0].info.run_id


def summary(store: Path, parent: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    run = client.get_run(parent)
    children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'",
                                  max_results=1000)
    scored = [(c.data.metrics.get("goodput_per_device", 0.0), c.info.run_name) for c in children]
    best = max(scored, default=(0.0, "-"))
    return {"trials": len(children), "pruned": sum("pdflow.pruned" in c.data.tags for c in children),
            "failed": sum(c.info.status == "FAILED" for c in children), "best": best[0], "best_run": best[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--store", default=None, help="a directory for mlflow.db (default: a temp dir)")
    args = parser.parse_args()
    store = Path(args.store or tempfile.mkdtemp(prefix="pdflow-search-")).resolve()
    store.mkdir(parents=True, exist_ok=True)
    grid = summary(store, sweep("grid_tiny", store, []))
    search = summary(store, sweep("search_tiny", store, [f"hydra.sweeper.n_trials={args.trials}"]))
    print(f"\nstore: {store}")
    print(f"grid:   {grid}")
    print(f"search: {search}")
    ratio = search["best"] / grid["best"] if grid["best"] else float("inf")
    print(f"best goodput per device, search / grid: {ratio:.3g} "
          f"({'met' if search['best'] >= grid['best'] and search['trials'] >= 20 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
