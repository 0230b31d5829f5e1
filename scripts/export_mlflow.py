#!/usr/bin/env python
"""An MLflow experiment's runs as one JSON file: each run's name, status, parent, params,
metrics, tags and its text artifacts (tables, rows, configs), so a store filled on a
machine that is gone (a device run's sqlite file, whose artifact paths name that machine)
travels as a plain file next to the results it backs.

    python scripts/export_mlflow.py --uri sqlite:///mlflow.db --experiment pdflow-bench --out runs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TEXT_SUFFIXES = (".md", ".json", ".yaml", ".txt")


def export(uri: str, experiment: str) -> list[dict]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in {uri}")
    runs = []
    for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
        artifacts = {}
        for item in client.list_artifacts(run.info.run_id):
            if not item.is_dir and item.path.endswith(TEXT_SUFFIXES):
                local = client.download_artifacts(run.info.run_id, item.path)
                artifacts[item.path] = Path(local).read_text()
        runs.append(dict(
            run_id=run.info.run_id, name=run.info.run_name, status=run.info.status,
            parent=run.data.tags.get("mlflow.parentRunId"), start_time_ms=run.info.start_time,
            params=dict(run.data.params), metrics=dict(run.data.metrics),
            tags={k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.log-model")},
            artifacts=artifacts))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", required=True)
    ap.add_argument("--experiment", default="pdflow-bench")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = export(args.uri, args.experiment)
    Path(args.out).write_text(json.dumps(dict(uri=args.uri, experiment=args.experiment, runs=runs), indent=1))
    print(f"{len(runs)} runs of {args.experiment!r} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
