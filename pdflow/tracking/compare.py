"""``pdflow compare``: a sweep's runs side by side, as a markdown table and a plot.

Rows are runs (by default the children of the latest sweep in the experiment), labelled
by the config groups they differ in (``--by``); columns are metrics (``--metrics``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from pdflow.tracking import store
from pdflow.tracking.callback import SWEEP_TAG
from pdflow.tracking.estimate_log import PRUNED_TAG
from pdflow.tracking.pareto import best_run, pareto_figure
from pdflow.tracking.run_logger import PARENT_TAG
from pdflow.tracking.tags import CHOICE

# Shown when present, in this order: what a deployment choice needs (per side pools,
# speed, latency percentiles, goodput, acceptance, estimate vs measured), then accuracy.
DEFAULT_METRICS = (
    "devices", "prefill_pool_blocks", "decode_pool_blocks", "prompt_throughput_tok_s", "ttft_p50_s",
    "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_throughput_tok_s", "output_tok_s_per_device",
    "goodput_req_s", "goodput_per_device", "est_goodput_req_s", "goodput_est_over_measured", "ttft_est_over_measured",
    "draft_acceptance_rate", "tokens_per_forward", "arith_strict", "arith_flexible", "needle_accuracy",
)


class CompareError(RuntimeError):
    pass


def sweep_children(client, experiment: str, parent: str | None = None, *, all_runs: bool = False):
    """The runs to compare and a title for them."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise CompareError(f"no experiment {experiment!r} in this store (see --experiment, --tracking-uri)")
    ids = [exp.experiment_id]
    if all_runs:
        runs = client.search_runs(ids, order_by=["attributes.start_time ASC"], max_results=1000)
        return [r for r in runs if r.data.tags.get(SWEEP_TAG) != "true"], f"all runs of {experiment}"
    if parent is None:
        parents = client.search_runs(ids, f"tags.`{SWEEP_TAG}` = 'true'",
                                     order_by=["attributes.start_time DESC"], max_results=1)
        if not parents:
            raise CompareError(f"experiment {experiment!r} has no sweep yet (run pdflow run -m ...; "
                               "or pass --all for every run)")
        parent = parents[0].info.run_id
    runs = client.search_runs(ids, f"tags.`{PARENT_TAG}` = '{parent}'", order_by=["attributes.start_time ASC"],
                              max_results=1000)
    return runs, f"sweep {parent}"


def varying_groups(runs) -> list[str]:
    """Config groups whose chosen option differs between the runs (none: rows are
    labelled by run name, which holds the job's overrides)."""
    groups = sorted({k[len(CHOICE):] for r in runs for k in r.data.tags if k.startswith(CHOICE)})
    return [g for g in groups if len({r.data.tags.get(CHOICE + g) for r in runs}) > 1]


def _labels(run, by: list[str]) -> list[str]:
    return [run.data.tags.get(CHOICE + g, "-") for g in by] if by else [run.info.run_name or run.info.run_id]


def pick_metrics(runs, wanted: list[str] | None) -> list[str]:
    if wanted:
        return wanted
    present = {k for r in runs for k in r.data.metrics}
    chosen = [m for m in DEFAULT_METRICS if m in present]
    return chosen or sorted(present)[:8]


def table(runs, by: list[str], metrics: list[str]) -> tuple[list[str], list[list[str]]]:
    header = [*(by or ["run"]), "status", *metrics]
    rows = []
    for r in runs:
        labels = _labels(r, by)
        values = [_fmt(r.data.metrics.get(m)) for m in metrics]
        rows.append([*labels, "PRUNED" if PRUNED_TAG in r.data.tags else r.info.status, *values])
    return header, rows


def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def comparison_markdown(runs) -> str:
    by = varying_groups(runs)
    return markdown(*table(runs, by, pick_metrics(runs, None)))


def plot(runs, by: list[str], metrics: list[str], path: Path) -> Path:
    """One bar chart per metric, a bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [" ".join(_labels(r, by)) for r in runs]
    cols = min(3, max(1, len(metrics)))
    nrows = -(-max(1, len(metrics)) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        values = [r.data.metrics.get(metric, math.nan) for r in runs]
        ax.bar(range(len(runs)), values, color="tab:blue")
        ax.set_title(metric, fontsize=9)
        ax.set_xticks(range(len(runs)), labels, rotation=30, ha="right", fontsize=8)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdflow compare", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="pdflow")
    parser.add_argument("--tracking-uri", default=None,
                        help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in this directory")
    parser.add_argument("--parent", default=None, help="a sweep's parent run id (default: the latest)")
    parser.add_argument("--all", action="store_true", help="every run of the experiment, not one sweep")
    parser.add_argument("--by", default=None, help="config groups labelling the rows, e.g. prefill,drafter")
    parser.add_argument("--metrics", default=None, help="comma-separated metric names")
    parser.add_argument("--plot", default="pdflow-compare.png", help="where to save the plot ('' for none)")
    parser.add_argument("--pareto", default="pdflow-pareto.png",
                        help="where to save the Pareto front, throughput per device vs TTFT p99 ('' for none)")
    args = parser.parse_args(argv)
    uri = store.resolve_uri(args.tracking_uri or default_uri(), Path.cwd())
    db = store.sqlite_path(uri)
    if db is not None and not db.exists():
        print(f"pdflow compare: no MLflow store at {db} (run pdflow run first, or pass --tracking-uri)",
              file=sys.stderr)
        return 2
    client = store.client(uri)
    try:
        runs, title = sweep_children(client, args.experiment, args.parent, all_runs=args.all)
    except CompareError as exc:
        print(f"pdflow compare: {exc}", file=sys.stderr)
        return 2
    by = args.by.split(",") if args.by else varying_groups(runs)
    metrics = pick_metrics(runs, args.metrics.split(",") if args.metrics else None)
    print(f"{title}: {len(runs)} runs\n")
    print(markdown(*table(runs, by, metrics)), end="")
    best, metric = best_run(runs)
    if best is not None:
        print(f"\nbest: {' '.join(_labels(best, by))} ({metric} {_fmt(best.data.metrics[metric])})")
    if args.plot and runs:
        print(f"\nplot: {plot(runs, by, metrics, Path(args.plot)).resolve()}")
    if args.pareto and runs:
        import matplotlib.pyplot as plt

        figure = pareto_figure(runs, label=lambda r: " ".join(_labels(r, by)))
        figure.savefig(args.pareto, dpi=110)
        plt.close(figure)
        print(f"Pareto front: {Path(args.pareto).resolve()}")
    return 0
