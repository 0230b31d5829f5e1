"""One MLflow run, opened for a ``pdflow run`` job and always closed with its status.

Used as a context manager: leaving it by an exception marks the run FAILED (with the
error as a tag and the traceback as an artifact) and re-raises. Inside a sweep the run
is a child of the sweep's parent (``mlflow.parentRunId``), whose id the sweep callback
passes in ``PARENT_ENV``. With tracking off every method does nothing.
"""

from __future__ import annotations

import json
import os
import traceback

from pdflow.spec import TrackingSpec
from pdflow.tracking import store
from pdflow.tracking.params import config_params, fit_value, redact
from pdflow.tracking.tags import run_tags

PARENT_ENV = "PDFLOW_MLFLOW_PARENT_RUN_ID"
PARENT_TAG = "mlflow.parentRunId"
MAX_TAG_VALUE = 8000


class TrackedRun:
    def __init__(self, tracking: TrackingSpec | None, *, run_name: str, tags: dict[str, str] | None = None,
                 parent_run_id: str | None = None):
        self.enabled = tracking is not None and tracking.enabled
        self.tracking, self.run_name = tracking, run_name
        self.extra_tags = dict(tags or {})
        self.parent_run_id = parent_run_id if parent_run_id is not None else os.environ.get(PARENT_ENV)
        self.run_id: str | None = None
        self.uri: str | None = None
        self._client = None
        self._experiment_id: str | None = None

    def __enter__(self) -> TrackedRun:
        if not self.enabled:
            return self
        self.uri = store.resolve_uri(self.tracking.uri)
        self._client = store.client(self.uri)
        exp = self._experiment_id = store.experiment_id(self._client, self.tracking.experiment, self.uri)
        tags = run_tags() | self.extra_tags
        if self.parent_run_id:
            tags[PARENT_TAG] = self.parent_run_id
        tags = {k: fit_value(v, MAX_TAG_VALUE) for k, v in tags.items()}
        self.run_id = self._client.create_run(exp, run_name=self.run_name, tags=tags).info.run_id
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enabled or self.run_id is None:
            return False
        status = "FINISHED"
        if exc_type is not None:
            status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
            self.set_tag("pdflow.error", f"{exc_type.__name__}: {exc}")
            self.log_text("error.txt", "".join(traceback.format_exception(exc_type, exc, tb)))
        self._client.set_terminated(self.run_id, status=status)
        return False

    def search_experiment(self, filter_string: str) -> list:
        """Runs of this run's experiment that match an MLflow filter (none, tracking off)."""
        if not self.enabled:
            return []
        return self._client.search_runs([self._experiment_id], filter_string)

    # -- logging ---------------------------------------------------------------------

    def set_tag(self, key: str, value: str) -> None:
        if self.enabled:
            self._client.set_tag(self.run_id, key, fit_value(value, MAX_TAG_VALUE))

    def set_tags(self, tags: dict[str, str]) -> None:
        """One write for all of them (each write to a sqlite store is a transaction)."""
        if self.enabled and tags:
            from mlflow.entities import RunTag

            batch = [RunTag(k, fit_value(v, MAX_TAG_VALUE)) for k, v in tags.items()]
            self._client.log_batch(self.run_id, tags=batch)

    def log_config(self, tree: dict, yaml_text: str) -> None:
        """Params flattened from the resolved config, and the config itself as YAML."""
        if self.enabled:
            self.log_params(tree)
            self.log_text("config.yaml", yaml_text)

    def log_params(self, tree: dict) -> None:
        """A nested dict as params (keys joined with dots, cut to MLflow's limits)."""
        if not self.enabled:
            return
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in config_params(tree).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit for params
            self._client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, metrics: dict[str, float]) -> None:
        if not self.enabled or not metrics:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_text(self, name: str, text: str) -> None:
        if self.enabled:
            self._client.log_text(self.run_id, text, name)

    def log_json(self, name: str, obj) -> None:
        if self.enabled:
            self._client.log_text(self.run_id, json.dumps(redact(obj), indent=1, default=str), name)

    def log_figure(self, name: str, figure) -> None:
        if self.enabled:
            self._client.log_figure(self.run_id, figure, name)
