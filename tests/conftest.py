"""Shared fixtures: composing specs from the packaged Hydra tree.

scripts/ goes on sys.path so the kernel tests import the (not installed) benchmark
harness's input builders as ``kernel_bench``. The repo root comes off it (``python -m
pytest`` puts it first): there the top-level ``kernels/`` (installed as ``pdflow.kernels``)
would shadow the PyPI ``kernels`` package that transformers (5.25 on) imports.

Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads
(``OMP_NUM_THREADS``, inherited by the processes a test starts unless they set their own,
as the engine's core and ranks do): two workers of two threads each on a 2-core machine
oversubscribe it, and OpenMP's barriers then make in-process model runs several times
slower. What a test computes does not change, only how many threads compute it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if (_workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(_workers)))

import pytest
import torch

from pdflow.graph import build_graph
from pdflow.spec.load import compose_spec

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT / "scripts"), *(p for p in sys.path if Path(p or ".").resolve() != ROOT)]
if _workers and "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may be imported already


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
