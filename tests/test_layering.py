"""Imports run one way, down: a package may import only packages below it (and itself).
An upward import (the transport reaching into the engine, a worker into the owner) is the
tangle the worker seam removed; this test fails on the first one that comes back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. Each may import anything listed before it.
ORDER = ["spec", "graph", "kernels", "parallel", "transfer", "attention", "model", "spec_decode",
         "worker", "engine", "bench", "tracking", "serve", "cli", "cli_run", "cli_serve"]
RANK = {name: i for i, name in enumerate(ORDER)}


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "kernels":
        return "kernels"
    return Path(rel.parts[1]).stem  # pdflow/<package>/... or pdflow/cli.py


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n.split(".")[1] for n in names if n.startswith("pdflow.") and len(n.split(".")) > 1}


def _sources():
    for path in sorted([*(ROOT / "pdflow").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        if path.parent == ROOT / "pdflow" and path.name == "__init__.py":
            continue  # the package root re-exports lazily
        yield path


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_import(path):
    package = _package_of(path)
    if package not in RANK:
        pytest.fail(f"{package} is not placed in the layering; add it to ORDER")
    tree = ast.parse(path.read_text())
    upward = sorted(t for t in _imported(tree) if t in RANK and RANK[t] > RANK[package])
    assert not upward, f"{path.relative_to(ROOT)} ({package}) imports upward: {upward}"


def test_the_check_catches_an_upward_import(tmp_path):
    tree = ast.parse("from pdflow.engine.llm import LLM\nimport pdflow.serve.app\n")
    assert _imported(tree) == {"engine", "serve"}
    assert RANK["engine"] > RANK["parallel"] and RANK["worker"] > RANK["parallel"]
