"""`pdflow plan`'s tables on an 80-column terminal: nothing cut (rank names whole, one
producer/consumer pair per cut row), unit groups named by what they hold, usable memory
explained from the spec, and every abbreviated column in the legend."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from pdflow.graph.render import LEGEND, render

CASES = [(), ("+experiment=ref_pp4_tp4_dspark",), ("prefill=pp2", "decode=tp2", "decode.num_kv_blocks=64")]


def rendered(graph, width: int = 80) -> str:
    out = io.StringIO()
    render(graph, Console(width=width, file=out, color_system=None))
    return out.getvalue()


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "default")
def test_80_columns_cut_nothing(graph_of, overrides):
    graph = graph_of(*overrides)
    text = rendered(graph)
    lines = text.splitlines()
    assert "…" not in text
    assert max(map(len, lines)) <= 80
    labels = [r.label for r in (*graph.producer.ranks, *graph.consumer.ranks)]
    for label in labels:
        assert label in text
    # Every head cut row names its pair in full, on one line.
    for cut in graph.cuts:
        pair = (graph.producer.ranks[cut.producer_rank].label, graph.consumer.ranks[cut.consumer_rank].label)
        assert any(pair[0] in line and pair[1] in line for line in lines), pair


def _fields(names) -> set[str]:
    return {name.split(".")[2] for name in names}


def test_unit_groups_say_what_they_hold(graph_of):
    graph = graph_of()
    text = rendered(graph, width=160)
    assert not any(f".{g}." in text for g in ("fp32_d64.k", "fp32_d64.v"))  # not a unit's name
    for cut in graph.cuts:
        for group in cut.groups:
            held = _fields(src for src, _ in group.units)
            assert held == {"k", "v"}  # each group of the tiny model holds K and V
    rows = [line for line in text.splitlines() if re.match(r"│ prefill\.s\d\.t\d +│ decode\.s\d\.t\d", line)]
    assert len(rows) == len(graph.cuts) and all("mha K+V" in row for row in rows)


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "default")
def test_usable_memory_is_explained_from_the_spec(graph_of, overrides):
    graph = graph_of(*overrides)
    flat = " ".join(rendered(graph, width=200).split())
    for role, budget in graph.budgets.items():
        assert f"{role}: {budget.sizing}" in flat and budget.sizing
        assert f"{budget.stages[0].usable_bytes / 1e9:.2f}" in flat  # the column the caption explains
        assert f"{budget.pool_blocks:,} blocks = {budget.pool_tokens:,} tokens" in flat
        if budget.fixed:
            assert f"{role}.num_kv_blocks" in flat


def test_legend_covers_the_terms_the_tables_use(graph_of):
    flat = " ".join(rendered(graph_of(), width=200).split())
    assert "Terms:" in flat
    for term, meaning in LEGEND.items():
        assert f"{term}: {meaning}" in flat
    for term in ("taps", "relays", "runs", "descs", "unit group"):
        assert term in LEGEND
