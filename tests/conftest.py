"""Shared fixtures: composing specs from the packaged Hydra tree.

scripts/ goes on sys.path so the kernel tests import the (not installed) benchmark
harness's input builders as ``kernel_bench``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdflow.graph import build_graph
from pdflow.spec.load import compose_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture
def graph_of():
    """Compose with overrides and build the run graph."""

    def make(*overrides: str):
        return build_graph(compose_spec(list(overrides)))

    return make


@pytest.fixture(scope="session")
def tiny_server():
    """The shipped tiny model served over HTTP (tests/serve_fixtures.py)."""
    from serve_fixtures import tiny_server as serve

    with serve() as server:
        yield server


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """A migrated, empty MLflow sqlite file; copy it to ``<dir>/mlflow.db`` to use it."""
    from serve_fixtures import migrated_store

    folder = tmp_path_factory.mktemp("mlflow-template")
    migrated_store(folder)
    return folder / "mlflow.db"
