"""Shared fixtures: composing specs from the packaged Hydra tree."""

from __future__ import annotations

import pytest

from pdflow.graph import build_graph
from pdflow.spec.load import compose_spec


@pytest.fixture
def graph_of():
    """Compose with overrides and build the run graph."""

    def make(*overrides: str):
        return build_graph(compose_spec(list(overrides)))

    return make
