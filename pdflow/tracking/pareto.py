"""The Pareto front of a sweep: output throughput per device against TTFT p99.

A run is on the front when no other run is both faster per device and quicker to a
first token. The best run (highest goodput per device; throughput per device when no
run measured goodput) is marked; pruned runs (never launched) are left out.
"""

from __future__ import annotations

import math

X, Y = "ttft_p99_s", "output_tok_s_per_device"
BEST = ("goodput_per_device", "output_tok_s_per_device")


def points(runs) -> list[tuple[object, float, float]]:
    """(run, x, y) for each run that measured both."""
    out = []
    for r in runs:
        x, y = r.data.metrics.get(X), r.data.metrics.get(Y)
        if x is not None and y is not None and not (math.isnan(x) or math.isnan(y)):
            out.append((r, x, y))
    return out


def front(pts: list[tuple[object, float, float]]) -> list[tuple[object, float, float]]:
    """The non-dominated points, by increasing x."""
    kept = [p for p in pts if not any(q[1] <= p[1] and q[2] >= p[2] and (q[1], q[2]) != (p[1], p[2]) for q in pts)]
    return sorted(kept, key=lambda p: p[1])


def best_run(runs):
    """The run a deployment choice picks, and the metric it was picked by (None: none)."""
    for metric in BEST:
        scored = [r for r in runs if r.data.metrics.get(metric) is not None]
        if scored and max(r.data.metrics[metric] for r in scored) > 0:
            return max(scored, key=lambda r: r.data.metrics[metric]), metric
    return None, None


def pareto_figure(runs, label=lambda r: r.info.run_name or r.info.run_id):
    """A matplotlib Figure: every run, the front joined, the best starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(runs)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter([p[1] for p in pts], [p[2] for p in pts], color="tab:gray", label="runs")
    edge = front(pts)
    ax.plot([p[1] for p in edge], [p[2] for p in edge], "-o", color="tab:blue", label="Pareto front")
    for run, x, y in edge:
        ax.annotate(label(run), (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    best, metric = best_run(runs)
    if best is not None and best.data.metrics.get(X) is not None:
        ax.scatter([best.data.metrics[X]], [best.data.metrics.get(Y, math.nan)], marker="*", s=260,
                   color="tab:red", label=f"best ({metric})", zorder=5)
    ax.set_xlabel("TTFT p99 (s)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title(f"{len(pts)} measured runs", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
