"""Where runs are kept: the tracking URI made absolute against the launch directory.

MLflow 3 resolves a relative ``sqlite:///mlflow.db`` against the process's current
directory, which Hydra may change per job; pdflow resolves it once, against the
directory ``pdflow`` was started in, so every job of a sweep writes the same store.
Artifacts go next to the database (``mlartifacts/``) rather than into the cwd.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

SQLITE = "sqlite:///"
QUIET_LOGGERS = ("alembic", "mlflow.store.db.utils", "mlflow.store.db", "mlflow.tracking")


def launch_dir() -> Path:
    """Hydra's original working directory inside a Hydra job; the cwd otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.cwd)
    except (ImportError, ValueError):
        pass
    return Path(os.getcwd())


def resolve_uri(uri: str, base: Path | None = None) -> str:
    """``sqlite:///rel.db`` -> ``sqlite:////abs/rel.db``; a bare or ``file:`` path made
    absolute; server URIs (http, databricks, ...) unchanged."""
    base = base or launch_dir()
    if uri.startswith(SQLITE):
        path = Path(uri[len(SQLITE):])
        return uri if path.is_absolute() else SQLITE + str((base / path).resolve())
    if uri.startswith("file:"):
        path = Path(uri[len("file:"):].removeprefix("//"))
        return uri if path.is_absolute() else "file://" + str((base / path).resolve())
    if "://" not in uri:
        return str((base / uri).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


def artifact_root(uri: str) -> str | None:
    """``<dir of the sqlite file>/mlartifacts`` for a sqlite store; None lets MLflow choose."""
    path = sqlite_path(uri)
    return (path.parent / "mlartifacts").as_uri() if path is not None else None


def quiet_mlflow() -> None:
    """Schema migrations log at INFO on a new store; a run's output is not the place."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def client(uri: str):
    """An MlflowClient on ``uri`` (already resolved), importing MLflow only here."""
    quiet_mlflow()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client, name: str, uri: str) -> str:
    """The experiment's id, creating it (artifacts next to a sqlite store) if needed.
    Two jobs racing to create it is the sweep callback's reason to create it first."""
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow_client.create_experiment(name, artifact_location=artifact_root(uri))
    except Exception:  # created meanwhile by another process
        found = mlflow_client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id
