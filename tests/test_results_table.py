"""``pdflow run``'s table: one row per workload with its own figures, run-level figures
on a line under it, every metric with ``--all``."""

from __future__ import annotations

from rich.console import Console

from pdflow.tracking.results_table import COLUMNS, all_metrics_table, run_line, workload_table


def rendered(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_one_row_per_workload_with_its_own_figures_and_dashes_for_missing():
    per_workload = {
        "arith": {"requests": 6, "errors": 1, "accuracy": 0.5, "ttft_p50_s": 0.25, "ttft_p99_s": 0.5,
                  "itl_p50_s": 0.012, "itl_p99_s": 0.0345, "output_throughput_tok_s": 123.45,
                  "draft_acceptance_rate": 0.625, "tokens_per_forward": 2.5},
        "prefill": {"requests": 2, "errors": 0, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0,
                    "output_throughput_tok_s": 3.0},
    }
    lines = rendered(workload_table("tiny", per_workload)).splitlines()
    header = next(line for line in lines if "workload" in line)
    assert all(c.header in header for c in COLUMNS)
    assert "TTFT in s, ITL in ms" in "\n".join(lines)
    arith = next(line for line in lines if "arith" in line).replace("│", " ").split()
    assert arith == ["arith", "6", "1", "0.500", "0.250", "0.500", "12.0", "34.5", "123.5", "0.625", "2.50"]
    prefill = next(line for line in lines if "prefill" in line).replace("│", " ").split()
    assert prefill == ["prefill", "2", "0", "-", "1.000", "2.000", "-", "-", "3.0", "-", "-"]
    assert len([line for line in lines if "│" in line]) == 2  # a row per workload, no more


def test_run_level_figures_go_on_one_line_known_names_first():
    line = run_line({"zz_other": 0.5, "kv_blocks_total": 512.0, "compile_s": 12.25, "startup_s": 30.0})
    assert line == "startup s: 30   compile s: 12.25   KV blocks: 512   zz_other: 0.5"


def test_all_metrics_table_shows_every_metric():
    metrics = {f"m{i}": float(i) / 3 for i in range(45)}
    text = rendered(all_metrics_table("tiny", metrics))
    assert all(f" {name} " in text for name in metrics)
