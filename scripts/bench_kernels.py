#!/usr/bin/env python
"""Check, then time, pdflow's Triton KV kernels on one GPU against same-run baselines.

One command for a short GPU lease: correctness on realistic shapes first (float64
references), then a device-to-device copy (the HBM floor), paged decode (vs copy and
vs torch gather+SDPA and contiguous SDPA), DSpark block attention, causal prefill (vs
SDPA causal on unpaged data) and the KV write, then a bounded sweep of block shapes,
warps, stages and split counts. Prints a short table last and writes results.json and
results.md under --out. Timings are single launches (``do_bench``); decode rows also
carry ``graph_vs_copy`` and Gluon prefill rows ``graph_vs_sdpa``, the same ratio with both
sides replayed in CUDA graphs, which keeps the launcher's host time out of a ~0.1 ms
kernel's window (bench/RESULTS.md, "Head dim 64, first run"). A ratio to a same-traffic
copy (``vs_same_copy``, ``graph_vs_copy``) is the median of three rounds timing the copy
and the kernel alternately, with its range, as the Gluon prefill's ratio to SDPA is of
seven alternating pairs: one timing each swung by a few percent. Imports only torch and
triton (no hydra): the harness is scripts/kernel_bench/ (not installed), which finds the
kernels as ``pdflow.kernels`` installed or, without an install, in this checkout.

    python scripts/bench_kernels.py --out bench/results/h200          # ~3-4 min
    python scripts/bench_kernels.py --check-only --out /tmp/k         # ~1 min smoke
    python scripts/bench_kernels.py --prefill-only --budget-s 150 --out DIR  # ~3 min
    python scripts/bench_kernels.py --dry-run --out /tmp/k            # CPU, tiny shapes
    python scripts/bench_kernels.py --fp8-kv --out bench/results/h200-fp8   # fp8 KV, ~1-2 min
    python scripts/bench_kernels.py --goals --out DIR   # block/decode-2K/KV-write sweeps, ~4 min
    python scripts/bench_kernels.py --no-sweep --head-dim 64 --out DIR  # every case at d64
    python scripts/bench_kernels.py --no-sweep --graph --out DIR  # every row in CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HARNESS = Path(__file__).resolve().parent  # holds kernel_bench/


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for results.json / results.md")
    ap.add_argument("--check-only", action="store_true", help="correctness checks only")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes under TRITON_INTERPRET on CPU (tests this script)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep")
    ap.add_argument("--prefill-only", action="store_true",
                    help="prefill only: default check, SDPA and default timings, then the "
                         "round-4 variants (each checked, then timed vs SDPA)")
    ap.add_argument("--fp8-kv", action="store_true",
                    help="fp8 (e4m3) KV only: write and attention checks vs the reference, then "
                         "fp8 decode vs the copy of its bytes and vs bf16 decode")
    ap.add_argument("--goals", action="store_true",
                    help="decode, block attention and the KV write, then sweeps of their tiles "
                         "(kernel_bench/goal_sweep.py), skipping prefill")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128,
                    help="head_dim of every case (32 query / 8 KV heads; the dry run halves it)")
    ap.add_argument("--graph", action="store_true",
                    help="time every row in CUDA graphs (do_bench_cudagraph), as the engine replays "
                         "its steps: no launcher host time in a ~0.1 ms kernel's window; copies "
                         "are SM copies (a captured copy_ is a copy-engine memcpy node)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="stop starting new timings after this many seconds")
    return ap.parse_args(argv)


class Run:
    """Holds the shapes for the mode, the timer and the rows collected so far."""

    def __init__(self, args):
        self.args, self.t0, self.rows, self.checks = args, time.time(), [], []
        self.dev = "cpu" if args.dry_run else "cuda"
        self.tiny = args.dry_run
        self.graph = args.graph and not args.dry_run  # every timing replayed in CUDA graphs
        self.copy_tbs = None
        self.same_copy_ms = {}  # (total bytes moved, in a graph) -> ms (benchmarks.same_traffic_copy_ms)
        self.info = None

    def checkpoint(self) -> None:
        """Write what we have so far: a crash later (a compiler abort) keeps these rows."""
        if self.info is not None:
            write_results(Path(self.args.out), {**self.info, "partial": True}, self, quiet=True)

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.args.budget_s

    def time_ms(self, fn) -> float:
        if self.tiny:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        if self.graph:
            from kernel_bench.benchmarks import graph_ms

            return graph_ms(self, fn)
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def add(self, kernel, shape, ms, *, nbytes=None, flops=None, baseline=None, note=""):
        row = {"kernel": kernel, "shape": shape, "ms": round(ms, 4), "note": note}
        if nbytes is not None:
            row["TB/s"] = round(nbytes / ms / 1e9, 3)
            if self.copy_tbs:
                row["vs_copy"] = round(row["TB/s"] / self.copy_tbs, 3)
        if flops is not None:
            row["TFLOP/s"] = round(flops / ms / 1e9, 1)
        if baseline is not None:
            row["vs_baseline"] = round(baseline / ms, 3)
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(HARNESS))
    import torch
    import triton
    from kernel_bench import benchmarks as cases
    from kernel_bench import fp8
    from kernel_bench.goal_sweep import sweep_goals
    from kernel_bench.shapes import heads
    from kernel_bench.sweep import sweep

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run to exercise this script on CPU")
        return 2
    run = Run(args)
    info = {
        "device": torch.cuda.get_device_name() if run.dev == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "heads": "q {}, kv {}, d {}".format(*heads(run)),
    }
    print(f"# {info}", flush=True)
    run.info = {**info, "elapsed_s": None}
    print("## correctness (float64 references)", flush=True)
    check = fp8.check_fp8 if args.fp8_kv else cases.check_prefill if args.prefill_only else cases.check_all
    check(run)
    ok = all(c["ok"] for c in run.checks)  # the defaults; a failing variant is only a row
    if not args.check_only:
        print("## timings", flush=True)
        steps = (cases.bench_prefill,) if args.prefill_only else (cases.bench_copy, fp8.bench_fp8) \
            if args.fp8_kv else (cases.bench_copy, cases.bench_decode, cases.bench_block,
                                 cases.bench_store) if args.goals else (
            cases.bench_copy, cases.bench_decode, cases.bench_block, cases.bench_prefill,
            cases.bench_store)
        for step in steps:
            if run.over_budget():
                print(f"  budget spent: skipped {step.__name__}")
                continue
            step(run)
            run.checkpoint()
        if args.goals:
            print("## sweep (issue 34's goals)", flush=True)
            sweep_goals(run)
        elif not args.no_sweep and not args.fp8_kv:
            print("## sweep", flush=True)
            sweep(run)
    info["elapsed_s"] = round(time.time() - run.t0, 1)
    write_results(Path(args.out), info, run)
    return 0 if ok else 1


def write_results(out: Path, info, run, quiet: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"info": info, "copy_TB/s": run.copy_tbs, "checks": run.checks, "rows": run.rows}
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    lines = [f"# kernel bench: {info['device']}", "",
             f"torch {info['torch']}, triton {info['triton']}, {info['elapsed_s']} s, "
             f"copy {run.copy_tbs} TB/s (read+write), heads {info.get('heads')}", "",
             "| check | rel err | tol | ok |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['err']:.2e} | {c['tol']:.0e} | {c['ok']} |"
              for c in run.checks]
    cols = ["kernel", "shape", "ms", "TB/s", "vs_copy", "vs_same_copy", "graph_vs_copy", "TFLOP/s", "vs_baseline",
            "graph_vs_sdpa", "note"]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in run.rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if quiet:
        return
    # The short table, last on stdout: checks in one line, sweep rows only as BEST.
    bad = [c["name"] for c in run.checks if not c["ok"]]
    print(f"\nchecks: {len(run.checks) - len(bad)}/{len(run.checks)} ok"
          + (f"; FAILED: {bad}" if bad else ""))
    print(f"copy {run.copy_tbs} TB/s (read+write); {info['elapsed_s']} s")
    short = [r for r in run.rows if not r["kernel"].startswith("sweep")
             or r.get("note", "").startswith("BEST")]
    print("| " + " | ".join(cols) + " |")
    for r in short:
        print("| " + " | ".join(cell(r, c) for c in cols) + " |")
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


def cell(row: dict, col: str) -> str:
    """A table cell: a ratio timed in alternating rounds shows its range beside it."""
    value = str(row.get(col, ""))
    spread = row.get(col + "_range")
    return f"{value} ({spread})" if spread else value


if __name__ == "__main__":
    sys.exit(main())
