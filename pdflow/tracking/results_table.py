"""What ``pdflow run`` prints: one row per workload, run-level figures on a line below.

Why not every metric: a run logs about 45 (latency per workload, accuracy per depth and
step count, throughputs, server gauges); a person reading a terminal wants, per workload,
how many requests, how many failed, how right, how fast. MLflow keeps every metric, and
``pdflow run --all`` prints them all (``all_metrics_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True, kw_only=True, slots=True)
class Column:
    """A column of the per-workload table: a header and the metric it shows, scaled."""

    header: str
    metric: str
    scale: float = 1.0
    digits: int = 3


COLUMNS = (
    Column(header="requests", metric="requests", digits=0),
    Column(header="errors", metric="errors", digits=0),
    Column(header="accuracy", metric="accuracy"),
    Column(header="TTFT p50", metric="ttft_p50_s"),
    Column(header="TTFT p99", metric="ttft_p99_s"),
    Column(header="ITL p50", metric="itl_p50_s", scale=1e3, digits=1),
    Column(header="ITL p99", metric="itl_p99_s", scale=1e3, digits=1),
    Column(header="out tok/s", metric="output_throughput_tok_s", digits=1),
    Column(header="acceptance", metric="draft_acceptance_rate"),
    Column(header="tok/fwd", metric="tokens_per_forward", digits=2),
)
UNITS = "TTFT in s, ITL in ms; acceptance: accepted / drafted tokens; tok/fwd: tokens per target forward"
# Wide enough for the table: a pipe or a log file is not a terminal, and rich would
# otherwise squeeze it into 80 columns and cut numbers short.
NOT_A_TERMINAL_WIDTH = 200

# Run-level figures (not any one workload's) get a readable name on the line under the
# table; one not listed here shows under its metric name.
RUN_FIGURES = {
    "startup_s": "startup s",
    "compile_s": "compile s",
    "kv_blocks_total": "KV blocks",
    "draft_acceptance_rate": "server draft acceptance",
}


def _cell(value: float | None, column: Column) -> str:
    if value is None:
        return "-"
    return f"{value * column.scale:.{column.digits}f}"


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.4g}"


def console() -> Console:
    """The console to print to: its terminal's width, or a wide one when not a terminal."""
    out = Console()
    return out if out.is_terminal else Console(width=NOT_A_TERMINAL_WIDTH)


def workload_table(name: str, per_workload: dict[str, dict[str, float]]) -> Table:
    """One row per workload; a figure the workload does not have is ``-``."""
    table = Table(title=f"pdflow run: {name}", caption=UNITS)
    table.add_column("workload", no_wrap=True)
    for column in COLUMNS:
        table.add_column(column.header, justify="right", no_wrap=True)
    for workload, figures in per_workload.items():
        table.add_row(workload, *(_cell(figures.get(c.metric), c) for c in COLUMNS))
    return table


def run_line(run_figures: dict[str, float]) -> str:
    """The run-level figures as one line, known ones first in ``RUN_FIGURES``' order."""
    names = [k for k in RUN_FIGURES if k in run_figures] + sorted(set(run_figures) - set(RUN_FIGURES))
    return "   ".join(f"{RUN_FIGURES.get(k, k)}: {_number(run_figures[k])}" for k in names)


def all_metrics_table(name: str, metrics: dict[str, float]) -> Table:
    """Every metric the run logged, one row each (``pdflow run --all``)."""
    table = Table(title=f"pdflow run: {name} (every metric)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in sorted(metrics):
        table.add_row(key, _number(metrics[key]))
    return table
