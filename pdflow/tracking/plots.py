"""The figure logged with every run: request latencies, and each accuracy breakdown."""

from __future__ import annotations


def results_figure(rows: list[dict], breakdowns: dict[str, dict[str, float]]):
    """Time to first token and end-to-end latency per request (in send order), then one
    bar chart per breakdown (accuracy by depth, by steps, ...). A matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + len(breakdowns)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.4), squeeze=False)
    ax = axes[0][0]
    done = sorted((r for r in rows if r.get("ok")), key=lambda r: r.get("sent_at_s") or 0.0)
    xs = range(len(done))
    ax.plot(xs, [r.get("ttft_s") or 0.0 for r in done], ".", label="time to first token")
    ax.plot(xs, [r.get("latency_s") or 0.0 for r in done], ".", label="latency")
    ax.set_xlabel("request (send order)")
    ax.set_ylabel("seconds")
    ax.set_title("per request", fontsize=10)
    ax.legend(fontsize=8)
    for ax, (title, series) in zip(axes[0][1:], breakdowns.items(), strict=True):
        names = list(series)
        ax.bar(range(len(names)), [series[n] for n in names], color="tab:green")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
