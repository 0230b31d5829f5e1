"""The run graph as a picture (``pdflow plan --png FILE``, ``plan.png`` of every run):
the producer's stages and ranks on the left, the consumer's on the right, each rank with
its layers and KV heads, and an arrow per head cut labelled with its runs per block.

Drawn from the graph alone (the same data as ``render``'s tables), with matplotlib's
object API (no pyplot state), so it is safe inside a server or a sweep.
"""

from __future__ import annotations

from pdflow.graph.placement import InstancePlan
from pdflow.graph.render import _heads, _layers
from pdflow.graph.run_graph import RunGraph

BOX_W, BOX_H, GAP = 3.2, 0.9, 0.35
COLUMN_X = {"producer": 0.0, "consumer": 7.0}
STAGE_COLORS = ("#dbe9f6", "#fde2c8", "#d9f0d3", "#eadcf0", "#f6e7a8", "#f4cccc", "#d0e0e3", "#e6e6e6")


def _place(plan: InstancePlan, x: float) -> dict[int, tuple[float, float]]:
    """Centre of every rank's box, top to bottom by stage then TP rank."""
    centres, y = {}, 0.0
    for stage in plan.stages:
        for rank in stage.ranks:
            centres[rank.rank] = (x + BOX_W / 2, -y)
            y += BOX_H + GAP
        y += GAP
    return centres


def _draw_instance(ax, title: str, plan: InstancePlan, centres: dict[int, tuple[float, float]]) -> None:
    from matplotlib.patches import FancyBboxPatch

    top = max(y for _, y in centres.values()) + BOX_H
    x0 = min(x for x, _ in centres.values()) - BOX_W / 2
    ax.text(x0 + BOX_W / 2, top, f"{title}\npp{plan.pp} x tp{plan.tp}", ha="center", va="bottom",
            fontsize=10, fontweight="bold")
    for stage in plan.stages:
        color = STAGE_COLORS[stage.index % len(STAGE_COLORS)]
        for rank in stage.ranks:
            cx, cy = centres[rank.rank]
            ax.add_patch(FancyBboxPatch((cx - BOX_W / 2, cy - BOX_H / 2), BOX_W, BOX_H,
                                        boxstyle="round,pad=0.03", facecolor=color, edgecolor="#333333"))
            extra = f" | draft {_heads(rank.draft_heads)}" if rank.draft_heads else ""
            drafter = " +drafter" if stage.holds_drafter and rank.tp_rank == 0 else ""
            ax.text(cx, cy + 0.18, f"{rank.label}{drafter}", ha="center", va="center", fontsize=8,
                    fontweight="bold")
            ax.text(cx, cy - 0.18, f"layers {_layers(stage.layer_start, stage.layer_stop)} | KV heads "
                    f"{_heads(rank.heads)}{extra}", ha="center", va="center", fontsize=7)


def plan_figure(graph: RunGraph):
    """A matplotlib ``Figure`` of the graph (refusals listed in red under it)."""
    from matplotlib.figure import Figure

    spec = graph.spec
    rows = max((len(p.ranks) + p.pp for p in (graph.producer, graph.consumer) if p is not None), default=1)
    height = 1.6 + rows * (BOX_H + GAP) * 0.75 + 0.3 * len(graph.refusals)
    fig = Figure(figsize=(10, max(3.0, height)))
    ax = fig.add_subplot()
    ax.set_axis_off()
    fig.suptitle(f"{spec.name}: {spec.model.name} ({spec.model.layers} layers, {spec.model.kv_heads} KV heads) | "
                 f"drafter {spec.drafter.kind} | transfer {spec.transfer.backend}/{spec.transfer.protocol}",
                 fontsize=10)
    bottom = 0.0
    if graph.producer is not None and graph.consumer is not None:
        places = {role: _place(plan, COLUMN_X[role]) for role, plan in
                  (("producer", graph.producer), ("consumer", graph.consumer))}
        _draw_instance(ax, "prefill (producer)", graph.producer, places["producer"])
        _draw_instance(ax, "decode (consumer)", graph.consumer, places["consumer"])
        for cut in graph.cuts:
            (px, py), (cx, cy) = places["producer"][cut.producer_rank], places["consumer"][cut.consumer_rank]
            start, end = (px + BOX_W / 2, py), (cx - BOX_W / 2, cy)
            ax.annotate("", xy=end, xytext=start,
                        arrowprops={"arrowstyle": "->", "color": "#1f5fa8", "lw": 1.0})
            runs = sum(len(g.runs) for g in cut.groups)
            mx, my = start[0] + 0.3 * (end[0] - start[0]), start[1] + 0.3 * (end[1] - start[1])
            ax.text(mx, my, f"{runs} runs, {cut.descriptors_per_block} descs, {cut.bytes_per_block:,} B/block",
                    fontsize=6, color="#1f5fa8", ha="center", va="bottom",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
        bottom = min(y for p in places.values() for _, y in p.values()) - BOX_H
    for i, refusal in enumerate(graph.refusals):
        ax.text(0.0, bottom - 0.4 * (i + 1), f"REFUSED {refusal.code.value}: {refusal.message}"[:160],
                fontsize=7, color="#b00020", ha="left", va="top")
    ax.set_xlim(-0.3, COLUMN_X["consumer"] + BOX_W + 0.3)
    ax.set_ylim(bottom - 0.4 * (len(graph.refusals) + 1), 1.3)
    return fig


def write_png(graph: RunGraph, path) -> None:
    plan_figure(graph).savefig(path, dpi=110, bbox_inches="tight")
