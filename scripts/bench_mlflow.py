"""A benchmark table as MLflow runs (the scripts' ``--mlflow URI``): one parent run for the
table, one child per row, so a bench table sits in the same store as ``pdflow run``
sweeps and exports with it. A row's numbers become metrics, its other fields params, a
row that failed is a FAILED child with its error."""

from __future__ import annotations

import contextlib
import json

from pdflow.spec import TrackingSpec
from pdflow.tracking.run_logger import TrackedRun


class RowFailed(RuntimeError):
    """Raised inside a row's run so that it closes FAILED with the row's error."""


def flat(row: dict, prefix: str = "") -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, params): numbers (bools too) are metrics, nested dicts are flattened
    with dots, everything else is a param (lists and strings as JSON/text)."""
    metrics: dict[str, float] = {}
    params: dict[str, str] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            m, p = flat(value, f"{name}.")
            metrics |= m
            params |= p
        elif isinstance(value, bool | int | float):
            metrics[name] = float(value)
        elif value is not None:
            params[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return metrics, params


def log_table(uri: str, *, experiment: str, table: str, text: str, rows: list[dict],
              tags: dict[str, str], name_of=lambda row: row.get("name", "row")) -> str:
    """Returns the parent run's id. ``rows``: the JSON the script writes; ``text``: the
    printed table (logged as ``table.md`` on the parent)."""
    tracking = TrackingSpec(enabled=True, uri=uri, experiment=experiment)
    with TrackedRun(tracking, run_name=table, tags=tags | {"pdflow.bench.table": table}) as parent:
        parent.log_text("table.md", text)
        for row in rows:
            metrics, params = flat({k: v for k, v in row.items() if k != "error"})
            with contextlib.suppress(RowFailed), TrackedRun(
                    tracking, run_name=name_of(row), tags=tags | {"pdflow.bench.table": table},
                    parent_run_id=parent.run_id) as run:
                run.log_params(params)
                run.log_json("row.json", row)
                run.log_metrics(metrics)
                if "error" in row:
                    raise RowFailed(str(row["error"]))
        return parent.run_id
