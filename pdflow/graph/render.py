"""Human-readable view of a run graph (``pdflow plan``): tables that stay readable on an
80-column terminal (rank names are never cut), captions saying where numbers come from,
and a legend of the terms."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from pdflow.graph.placement import InstancePlan
from pdflow.graph.run_graph import RunGraph

GB = 1e9
LEGEND = {
    "taps": "target layers whose hidden states feed the drafter, captured by the stage "
    "holding the layer",
    "relays": "taps a PP stage passes to the next one with its activations, so the "
    "drafter's stage gets them all",
    "units": "one field (K, V, indexer key) of one layer for one block: what moves",
    "unit group": "the units that share one run list, per family: fields and layers "
    "(drafter rows)",
    "runs": "contiguous byte ranges one head cut copies per unit and block (1: the heads "
    "lie together)",
    "descs": "transfer descriptors per block between the two ranks (units x runs)",
}


# Column kinds: a rank name or a short value (exactly as wide as its longest cell, so it
# is never wrapped or cut; its header wraps between words), or text that wraps to fit.
LABEL, VALUE, TEXT = "label", "value", "text"


def _table(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, ...]],
           caption: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for i, (header, kind) in enumerate(columns):
        if kind == TEXT:
            words = [w for text in (header, *(row[i] for row in rows)) for w in text.split()]
            table.add_column(header, min_width=max(map(len, words)))
            continue
        width = max([*map(len, header.split()), *(len(row[i]) for row in rows)])
        if kind == LABEL:
            width = max(width, len(header))
        table.add_column(header, width=width)
    for row in rows:
        table.add_row(*row)
    return table


def _unit_parts(name: str) -> tuple[str, str, str, int]:
    """(family, geometry, field, layer) of ``family.geometry.field.layer_N``."""
    family, geometry, field, layer = name.split(".")
    return family, geometry, field, int(layer.removeprefix("layer_"))


def _span(numbers: list[int]) -> str:
    lo, hi = min(numbers), max(numbers)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def describe_units(names: list[str], *, geometry: bool = True) -> str:
    """What a set of units holds, per family: ``mha fp32_d64 K+V layers 0-1`` (without
    geometry: ``mha K+V 0-1``)."""
    by_family: dict[tuple[str, str], tuple[set[str], list[int]]] = {}
    for name in names:
        family, geom, field, layer = _unit_parts(name)
        fields, layers = by_family.setdefault((family, geom), (set(), []))
        fields.add(field)
        layers.append(layer)
    parts = []
    for (family, geom), (fields, layers) in by_family.items():
        held = "+".join(f.upper() if len(f) == 1 else f for f in sorted(fields, key=lambda f: (f != "k", f)))
        if geometry:
            rows = "rows" if family == "draft" else "layers"
            parts.append(f"{family} {geom} {held} {rows} {_span(layers)}")
        else:
            parts.append(f"{family} {held} {_span(layers)}")
    return "; ".join(parts)


def _heads(heads: tuple[int, ...]) -> str:
    if not heads:
        return "-"
    return str(heads[0]) if len(heads) == 1 else f"{heads[0]}-{heads[-1]}"


def _layers(start: int, stop: int) -> str:
    return f"{start}-{stop - 1} ({stop - start})"


def _instance_table(title: str, plan: InstancePlan, graph: RunGraph) -> Table:
    rows = []
    for stage in plan.stages:
        for rank in stage.ranks:
            first = rank.tp_rank == 0
            rows.append((
                str(stage.index) if first else "",
                _layers(stage.layer_start, stage.layer_stop) if first else "",
                rank.label,
                _heads(rank.heads),
                _heads(rank.draft_heads),
                ",".join(map(str, stage.taps_captured)) if first and stage.taps_captured else "",
                ",".join(map(str, stage.taps_relayed)) if first and stage.taps_relayed else "",
            ))
    columns = [("stage", VALUE), ("layers", VALUE), ("rank", LABEL), ("KV heads", VALUE),
               ("draft heads", VALUE), ("taps captured", TEXT), ("relays on", TEXT)]
    return _table(title, columns, rows)


def _units_table(graph: RunGraph) -> Table:
    dests: dict[int, set[int]] = {}
    for cut in graph.cuts:
        dests.setdefault(cut.producer_rank, set()).add(cut.consumer_rank)
    rows = []
    for rank in graph.producer.ranks:
        kinds = Counter(u.family for u in rank.units)
        rows.append((
            rank.label,
            ", ".join(f"{n} {k}" for k, n in kinds.items()),
            describe_units([u.name for u in rank.units]) or "-",
            ", ".join(graph.consumer.ranks[c].label for c in sorted(dests.get(rank.rank, ()))),
        ))
    columns = [("producer rank", LABEL), ("units", TEXT), ("holds", TEXT), ("lands on", TEXT)]
    return _table("KV units per producer rank -> consumer ranks", columns, rows)


def _cuts_table(graph: RunGraph) -> Table:
    rows = []
    for cut in graph.cuts:
        for i, group in enumerate(cut.groups):
            rows.append((
                graph.producer.ranks[cut.producer_rank].label if i == 0 else "",
                graph.consumer.ranks[cut.consumer_rank].label if i == 0 else "",
                describe_units([src for src, _ in group.units], geometry=False),
                str(len(group.units)),
                str(len(group.runs)),
                str(cut.descriptors_per_block) if i == 0 else "",
                f"{cut.bytes_per_block:,}" if i == 0 else "",
            ))
    columns = [("producer", LABEL), ("consumer", LABEL), ("unit group", TEXT), ("units", VALUE),
               ("runs", VALUE), ("descs", VALUE), ("bytes", VALUE)]
    return _table("Head cut per block (producer rank -> consumer rank)", columns, rows,
                  caption=f"bytes per transferred block: {graph.transfer_bytes_per_block:,} "
                          "(every cut above; the producer's pdflow_kv_transfer_bytes_total / "
                          "_blocks_total counts the same)")


def _usable_caption(graph: RunGraph) -> str:
    """Where each side's usable bytes come from (graph/memory.py)."""
    parts = [f"{role}: {b.sizing}" for role, b in graph.budgets.items()]
    fixed = [role for role, b in graph.budgets.items() if b.fixed]
    pool = (f"; a (fixed) pool is {', '.join(f'{r}.num_kv_blocks' for r in fixed)}" if fixed else "")
    return ("usable GB per device: " + "; ".join(parts) + ". blocks = (usable - weights - "
            "activations - transfer buffers) / bytes per block (transfer: the KV pairs' send or receive "
            f"buffers on the stage's busiest rank); the stage with the fewest binds the pool{pool}.")


def _budget_table(graph: RunGraph) -> Table:
    rows = []
    for role, budget in graph.budgets.items():
        for s in budget.stages:
            mark = "*" if s.stage == budget.binding_stage else ""
            rows.append((
                role if s.stage == 0 else "",
                f"{s.stage}{mark}",
                f"{s.bytes_per_block / 1e6:.3f}",
                f"{s.weight_bytes / GB:.2f}",
                f"{s.activation_bytes / GB:.2f}",
                f"{s.transfer_bytes / GB:.2f}",
                f"{s.usable_bytes / GB:.2f}",
                f"{s.blocks:,}",
                (f"{budget.pool_blocks:,} blocks = {budget.pool_tokens:,} tokens"
                 + (" (fixed)" if budget.fixed else "")) if s.stage == 0 else "",
            ))
    columns = [(h, VALUE) for h in ("side", "stage", "MB per block", "weights GB", "activ. GB",
                                    "transfer GB", "usable GB", "blocks")] + [("pool", TEXT)]
    return _table("KV block budget (* binds the pool)", columns, rows, caption=_usable_caption(graph))


def render(graph: RunGraph, console: Console | None = None) -> None:
    if console is None:
        probe = Console()
        console = Console(width=max(140, probe.width)) if not probe.is_terminal else probe
    spec = graph.spec
    d = spec.drafter
    m = spec.model
    experts = f", {m.experts} experts top-{m.experts_per_token}" if m.experts else ""
    console.print(
        f"[bold]{spec.name}[/]: model {m.name} ({m.layers} layers, "
        f"{m.kv_heads} KV heads, d{m.head_dim}{experts}) | prefill tp{spec.prefill.tp} "
        f"pp{spec.prefill.pp} -> decode tp{spec.decode.tp} pp{spec.decode.pp} | drafter {d.kind} | "
        f"transfer {graph.transfer}"
    )
    if graph.producer is not None:
        console.print(_instance_table("Producer (prefill)", graph.producer, graph))
    if graph.consumer is not None:
        title = "Consumer (decode)" if graph.producer is not None else "Decode (monolithic: no prefill instance)"
        console.print(_instance_table(title, graph.consumer, graph))
    if graph.drafter is not None:
        dp = graph.drafter
        writer = graph.producer or graph.consumer
        hops = " -> ".join(
            f"s{s.index}[{','.join(map(str, s.taps_relayed)) or '-'}]" for s in writer.stages
        )
        lives = (f"lives on producer stage {dp.drafter_stage} and every consumer rank; producer proposes: "
                 f"{dp.producer_proposes}" if graph.producer is not None else "lives on every decode rank")
        console.print(
            f"Drafter {dp.kind}: {d.layers} layers, {d.kv_heads} KV heads, page {d.page_tokens}, "
            f"k={d.num_speculative_tokens}; taps {list(dp.taps)} captured on stages "
            f"{[dp.tap_stage[t] for t in dp.taps]}; relay {hops}; {lives}"
        )
    if graph.cuts:
        console.print(_units_table(graph))
        console.print(_cuts_table(graph))
    if graph.budgets:
        console.print(_budget_table(graph))
    if graph.producer is not None:
        console.print("Terms: " + "; ".join(f"[bold]{k}[/]: {v}" for k, v in LEGEND.items()) + ".")
    if graph.refusals:
        table = Table(title=f"REFUSED ({len(graph.refusals)})", title_justify="left", style="red")
        for col in ("code", "why", "fix"):
            table.add_column(col)
        for r in graph.refusals:
            table.add_row(r.code.value, r.message, r.fix)
        console.print(table)
    else:
        console.print("[green]allowed[/]: no refusals")
