"""The Hydra callback that makes a ``pdflow run -m`` sweep one MLflow parent run.

On multirun start it creates the experiment (so parallel jobs do not race to create it
in one sqlite file) and the parent run, and hands the parent's id to the jobs in
``PARENT_ENV`` (inherited by launcher subprocesses). Each job opens its own child
(``TrackedRun``), which is FAILED when the job raises. Hydra skips ``on_multirun_end``
when a job failed, so the parent is also closed by ``close_open_sweeps`` (the CLI calls
it on the way out) and, failing that, at interpreter exit.

It acts only for ``pdflow run`` (Hydra job name ``JOB_NAME``) with tracking enabled;
``pdflow plan -m`` sweeps log nothing.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pdflow.tracking import store
from pdflow.tracking.estimate_log import PRUNED_TAG
from pdflow.tracking.params import fit_value
from pdflow.tracking.run_logger import MAX_TAG_VALUE, PARENT_ENV, PARENT_TAG
from pdflow.tracking.tags import git_tags, hardware_tags
from pdflow.tracking.trial_cache import DUPLICATE_TAG

JOB_NAME = "pdflow_run"
SWEEP_TAG = "pdflow.sweep"
# Parents this process opened and has not closed: run id -> tracking URI.
_open: dict[str, str] = {}


def close_open_sweeps() -> None:
    """Close every parent this process opened: FAILED when a child failed or none
    finished, FINISHED otherwise. A summary of the children goes on the parent."""
    for run_id, uri in list(_open.items()):
        _open.pop(run_id, None)
        client = store.client(uri)
        from mlflow.entities import RunTag

        run = client.get_run(run_id)
        children = client.search_runs([run.info.experiment_id], f"tags.`{PARENT_TAG}` = '{run_id}'")
        statuses = [c.info.status for c in children]
        ok = bool(statuses) and all(s == "FINISHED" for s in statuses)
        failed = sum(s == "FAILED" for s in statuses)
        pruned = sum(PRUNED_TAG in c.data.tags for c in children)
        # Each deployment once: a duplicate trial (``trial_cache``) measured nothing of its own.
        distinct = [c for c in children if DUPLICATE_TAG not in c.data.tags]
        client.log_batch(run_id, tags=[RunTag("pdflow.sweep.children", str(len(statuses))),
                                       RunTag("pdflow.sweep.failed", str(failed)),
                                       RunTag("pdflow.sweep.pruned", str(pruned)),
                                       RunTag("pdflow.sweep.duplicates", str(len(children) - len(distinct)))])
        try:
            from pdflow.tracking.compare import comparison_markdown

            client.log_text(run_id, comparison_markdown(distinct), "comparison.md")
            _log_pareto(client, run_id, distinct)
        finally:
            client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")
            if os.environ.get(PARENT_ENV) == run_id:
                del os.environ[PARENT_ENV]


def _log_pareto(client, run_id: str, children) -> None:
    """The sweep's Pareto front as ``pareto.png`` on the parent, the best run as a tag."""
    import matplotlib.pyplot as plt

    from pdflow.tracking.pareto import best_run, pareto_figure

    best, metric = best_run(children)
    if best is not None:
        client.set_tag(run_id, "pdflow.sweep.best", f"{best.info.run_name} ({metric} "
                       f"{best.data.metrics[metric]:.4g}, run {best.info.run_id})")
    figure = pareto_figure(children)
    client.log_figure(run_id, figure, "pareto.png")
    plt.close(figure)


class MlflowSweepCallback(Callback):
    def _tracking(self, config: DictConfig):
        """(uri, experiment) when this sweep should be tracked, else None."""
        if config.hydra.job.name != JOB_NAME or not config.get("tracking") or not config.tracking.enabled:
            return None
        base = Path(config.hydra.runtime.cwd) if config.hydra.runtime.cwd else None
        return store.resolve_uri(config.tracking.uri, base), config.tracking.experiment

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        found = self._tracking(config)
        if found is None:
            return
        uri, experiment = found
        client = store.client(uri)
        exp = store.experiment_id(client, experiment, uri)
        overrides = " ".join(config.hydra.overrides.task)
        tags = git_tags() | hardware_tags() | {SWEEP_TAG: "true", "pdflow.overrides": overrides}
        tags = {k: fit_value(v, MAX_TAG_VALUE) for k, v in tags.items()}
        run_id = client.create_run(exp, run_name=f"{config.name} sweep", tags=tags).info.run_id
        if not _open:
            atexit.register(close_open_sweeps)
        _open[run_id] = uri
        os.environ[PARENT_ENV] = run_id

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        close_open_sweeps()
