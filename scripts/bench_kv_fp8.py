#!/usr/bin/env python
"""fp8 (e4m3) KV against the default KV dtype on the shipped model, P/D PPn -> TPn with DSpark
(issue 35's acceptance: arith strict within 1 point, DSpark acceptance within 2 points,
retrieval unchanged; bytes per transferred block halved against bf16).

Two rows, each the default ``pdflow run`` deployment (``prefill=ppN decode=tpN
drafter=dspark``), the second with ``model.kv_dtype=fp8_e4m3`` on both sides: held-out
five-shot arithmetic (lm-eval's GSM8K strict/flexible rules), acceptance over those
requests, needle retrieval at five depths, and the bytes the producer's ranks moved per
landed block (its transfer counter, ``pdflow_kv_transfer_bytes_total / _blocks_total``)
beside the plan's (``RunGraph.transfer_bytes_per_block``) for this dtype and for bf16.

    python scripts/bench_kv_fp8.py --device cpu --gpus 4 --n 40 --per-depth 4     # CPU, minutes
    python scripts/bench_kv_fp8.py --device cuda --gpus 4 --n 200 --per-depth 10  # 4 GPUs (both sides share them)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

FP8 = "model.kv_dtype=fp8_e4m3"


def parse_args(argv=None) -> argparse.Namespace:
    from bench_gpu_accuracy import add_eval_args, default_transfer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(p)
    p.add_argument("--out", help="folder: the table (markdown) and the raw numbers (JSON)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both rows")
    args = default_transfer(p.parse_args(argv))
    args.mlflow = None
    return args


def measure(overrides: list[str], args) -> dict:
    """One row: arithmetic then retrieval on one deployment, and its transfer counter."""
    from bench_gpu_accuracy import run_tasks

    from pdflow import Deployment, compose
    from pdflow.graph import build_graph

    spec = compose(overrides)
    start = time.perf_counter()
    with Deployment(spec) as d:
        ran = run_tasks(d, args)
        moved, blocks = d.producer.kv_bytes_sent, d.producer.kv_blocks_sent
    arith_outs, needle_outs = ran["arith_outs"], ran["needle_outs"]
    drafted = sum(o.num_drafted for o in arith_outs)
    accepted = sum(o.num_accepted for o in arith_outs)
    return dict(arith=ran["arith"], needle=ran["needle"], context_len=ran["context_len"],
                acceptance=accepted / drafted if drafted else None, drafted=drafted,
                errors=[o.error for o in arith_outs + needle_outs if o.error][:3],
                kv_bytes_moved=moved, kv_blocks_landed=blocks,
                counter_bytes_per_block=moved / blocks if blocks else None,
                plan_bytes_per_block=build_graph(spec).transfer_bytes_per_block,
                kv_dtype=spec.model.kv_dtype, wall_s=time.perf_counter() - start)


def verdicts(base: dict, fp8: dict, bf16_plan: int) -> list[str]:
    strict = fp8["arith"]["arith_strict"] - base["arith"]["arith_strict"]
    acc = None if base["acceptance"] is None or fp8["acceptance"] is None else fp8["acceptance"] - base["acceptance"]
    retr = fp8["needle"]["needle_accuracy"] - base["needle"]["needle_accuracy"]
    ratio = fp8["counter_bytes_per_block"] / bf16_plan if fp8["counter_bytes_per_block"] else None
    return [
        f"arith strict: {strict * 100:+.1f} points (within 1: {'yes' if abs(strict) <= 0.01 else 'NO'})",
        f"dspark acceptance: {'-' if acc is None else f'{acc * 100:+.1f}'} points "
        f"(within 2: {'-' if acc is None else 'yes' if abs(acc) <= 0.02 else 'NO'})",
        f"retrieval: {retr * 100:+.1f} points (unchanged: {'yes' if retr == 0 else 'NO'})",
        f"bytes per transferred block: fp8 {fp8['counter_bytes_per_block']} (counter) = "
        f"{fp8['plan_bytes_per_block']} (plan); bf16 plan {bf16_plan}: ratio "
        f"{'-' if ratio is None else f'{ratio:.4f}'} (halved: {'yes' if ratio and ratio <= 0.51 else 'NO'})",
    ]


def main(argv=None) -> int:
    from bench_engine import git_commit
    from bench_gpu_accuracy import fmt
    from bench_gpu_pd import command_line, device_overrides, hardware

    from pdflow import compose
    from pdflow.graph import build_graph

    args = parse_args(argv)
    base = ["model=tiny", *device_overrides(args), f"prefill=pp{args.gpus}", f"decode=tp{args.gpus}",
            "drafter=dspark", *args.overrides]
    rows = {}
    for name, extra in (("default KV", []), ("fp8_e4m3 KV", [FP8])):
        rows[name] = measure([*base, *extra], args)
        r = rows[name]  # as each row ends: a long CPU run shows its progress
        print(f"{name}: strict {r['arith']['arith_strict']:.3f} acceptance {r['acceptance']} retrieval "
              f"{r['needle']['needle_accuracy']:.2f} bytes/block {r['counter_bytes_per_block']} "
              f"({r['wall_s']:.0f} s)", flush=True)
    bf16_plan = build_graph(compose([*base, "model.kv_dtype=bf16"])).transfer_bytes_per_block
    head = ["KV", "dtype", "strict", "flexible", "acceptance", "retrieval", "bytes/block (counter)",
            "bytes/block (plan)", "errors", "wall s"]
    lines = [f"bench_kv_fp8 on {hardware(args.device)}, commit {git_commit()}, model tiny, "
             f"P/D PP{args.gpus}->TP{args.gpus} dspark, transfer={args.transfer}",
             f"command: {command_line(argv)}",
             f"{args.n} held-out {args.k_shot}-shot arithmetic problems, {args.per_depth} retrieval facts "
             f"per depth ({rows['default KV']['context_len']} tokens)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        lines.append("| " + " | ".join([
            name, r["kv_dtype"], fmt(r["arith"]["arith_strict"]), fmt(r["arith"]["arith_flexible"]),
            fmt(r["acceptance"]), fmt(r["needle"]["needle_accuracy"], ".2f"),
            fmt(r["counter_bytes_per_block"], ".0f"), str(r["plan_bytes_per_block"]),
            str(len(r["errors"])), f"{r['wall_s']:.0f}"]) + " |")
    lines += ["", *verdicts(rows["default KV"], rows["fp8_e4m3 KV"], bf16_plan)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv_fp8.md").write_text(text)
        (out / "kv_fp8.json").write_text(json.dumps(rows, indent=1, default=str))
    return 1 if any(r["errors"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
