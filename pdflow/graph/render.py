"""Human-readable view of a run graph (``pdflow plan``)."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from pdflow.graph.placement import InstancePlan
from pdflow.graph.run_graph import RunGraph

GB = 1e9


def _heads(heads: tuple[int, ...]) -> str:
    if not heads:
        return "-"
    return str(heads[0]) if len(heads) == 1 else f"{heads[0]}-{heads[-1]}"


def _layers(start: int, stop: int) -> str:
    return f"{start}-{stop - 1} ({stop - start})"


def _instance_table(title: str, plan: InstancePlan, graph: RunGraph) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("stage", "layers", "rank", "KV heads", "draft heads", "taps captured", "relays on"):
        table.add_column(col)
    for stage in plan.stages:
        for rank in stage.ranks:
            first = rank.tp_rank == 0
            table.add_row(
                str(stage.index) if first else "",
                _layers(stage.layer_start, stage.layer_stop) if first else "",
                rank.label,
                _heads(rank.heads),
                _heads(rank.draft_heads),
                ",".join(map(str, stage.taps_captured)) if first and stage.taps_captured else "",
                ",".join(map(str, stage.taps_relayed)) if first and stage.taps_relayed else "",
            )
    return table


def _units_table(graph: RunGraph) -> Table:
    table = Table(title="KV units per producer rank -> consumer ranks", title_justify="left")
    for col in ("producer rank", "units", "first .. last", "lands on"):
        table.add_column(col)
    dests: dict[int, set[int]] = {}
    for cut in graph.cuts:
        dests.setdefault(cut.producer_rank, set()).add(cut.consumer_rank)
    for rank in graph.producer.ranks:
        kinds = Counter(u.family for u in rank.units)
        names = [u.name for u in rank.units]
        table.add_row(
            rank.label,
            ", ".join(f"{n} {k}" for k, n in kinds.items()),
            f"{names[0]} .. {names[-1]}" if names else "-",
            ", ".join(graph.consumer.ranks[c].label for c in sorted(dests.get(rank.rank, ()))),
        )
    return table


def _cuts_table(graph: RunGraph) -> Table:
    table = Table(title="Head cut per block (producer rank -> consumer rank)", title_justify="left")
    for col in ("producer", "consumer", "unit group", "units", "runs/unit", "descriptors", "bytes"):
        table.add_column(col)
    for cut in graph.cuts:
        for i, group in enumerate(cut.groups):
            sample = group.units[0][0]
            table.add_row(
                graph.producer.ranks[cut.producer_rank].label if i == 0 else "",
                graph.consumer.ranks[cut.consumer_rank].label if i == 0 else "",
                sample.rsplit(".", 1)[0],
                str(len(group.units)),
                str(len(group.runs)),
                str(cut.descriptors_per_block) if i == 0 else "",
                f"{cut.bytes_per_block:,}" if i == 0 else "",
            )
    return table


def _budget_table(graph: RunGraph) -> Table:
    table = Table(title="KV block budget (* binds the pool)", title_justify="left")
    for col in (
        "side",
        "stage",
        "bytes/block",
        "weights GB",
        "activations GB",
        "usable GB",
        "blocks",
        "pool",
    ):
        table.add_column(col)
    for role, budget in graph.budgets.items():
        for s in budget.stages:
            mark = "*" if s.stage == budget.binding_stage else ""
            table.add_row(
                role if s.stage == 0 else "",
                f"{s.stage}{mark}",
                f"{s.bytes_per_block / 1e6:.3f} MB",
                f"{s.weight_bytes / GB:.2f}",
                f"{s.activation_bytes / GB:.2f}",
                f"{s.usable_bytes / GB:.2f}",
                f"{s.blocks:,}",
                (f"{budget.pool_blocks:,}" + (" (fixed)" if budget.fixed else "")) if s.stage == 0 else "",
            )
    return table


def render(graph: RunGraph, console: Console | None = None) -> None:
    if console is None:
        probe = Console()
        console = Console(width=max(140, probe.width)) if not probe.is_terminal else probe
    spec = graph.spec
    d = spec.drafter
    console.print(
        f"[bold]{spec.name}[/]: model {spec.model.name} ({spec.model.layers} layers, "
        f"{spec.model.kv_heads} KV heads, d{spec.model.head_dim}) | prefill tp{spec.prefill.tp} "
        f"pp{spec.prefill.pp} -> decode tp{spec.decode.tp} pp{spec.decode.pp} | drafter {d.kind} | "
        f"transfer {spec.transfer.backend}/{spec.transfer.protocol}"
    )
    if graph.producer is not None:
        console.print(_instance_table("Producer (prefill)", graph.producer, graph))
        console.print(_instance_table("Consumer (decode)", graph.consumer, graph))
    if graph.drafter is not None:
        dp = graph.drafter
        hops = " -> ".join(
            f"s{s.index}[{','.join(map(str, s.taps_relayed)) or '-'}]" for s in graph.producer.stages
        )
        console.print(
            f"Drafter {dp.kind}: {d.layers} layers, {d.kv_heads} KV heads, page {d.page_tokens}, "
            f"k={d.num_speculative_tokens}; taps {list(dp.taps)} captured on stages "
            f"{[dp.tap_stage[t] for t in dp.taps]}; relay {hops}; lives on producer stage "
            f"{dp.drafter_stage} and every consumer rank; producer proposes: {dp.producer_proposes}"
        )
    if graph.cuts:
        console.print(_units_table(graph))
        console.print(_cuts_table(graph))
    if graph.budgets:
        console.print(_budget_table(graph))
    if graph.refusals:
        table = Table(title=f"REFUSED ({len(graph.refusals)})", title_justify="left", style="red")
        for col in ("code", "why", "fix"):
            table.add_column(col)
        for r in graph.refusals:
            table.add_row(r.code.value, r.message, r.fix)
        console.print(table)
    else:
        console.print("[green]allowed[/]: no refusals")
