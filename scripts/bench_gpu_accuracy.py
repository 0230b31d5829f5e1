#!/usr/bin/env python
"""The reference deployment's accuracy table (issue 18), through ``pdflow.compose`` + ``Deployment``.

Rows, on the shipped model (``--gpus n``; 4 is the reference deployment's PP4 -> TP4):
one process without a drafter (the reference every other row's greedy tokens are compared
with), P/D PPn -> TPn with the DSpark drafter, the same with the page-ignorant draft cut
forced (``transfer.force_page_ignorant_cut=[draft]``: the drafter's context K/V cut as if
its 16-token pages were whole blocks; the target's KV stays exact, so outputs must not
change while the drafter reads other positions: acceptance must drop, which is how the
wrong cut shows), and TPn -> TPn with DSpark.

Columns: held-out five-shot arithmetic scored by lm-eval's GSM8K strict/flexible rules
(``pdflow.bench.workloads.ArithWorkload``), acceptance and tokens per forward over those
requests, how many requests' greedy tokens equal the one-process run's, and needle
retrieval at five depths of a haystack at the model's longest context (``max_model_len``
less the answer). Every request of a workload is submitted at once.

    python scripts/bench_gpu_accuracy.py --device cuda --gpus 4 --mlflow sqlite:///mlflow.db   # 4x H200
    python scripts/bench_gpu_accuracy.py --device cpu --gpus 2 --n 4 --per-depth 1 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))


def right_cut(n: int) -> str:
    return f"P/D PP{n}->TP{n} dspark"


def wrong_cut(n: int) -> str:
    return f"{right_cut(n)} (page-ignorant draft cut)"


def layouts(n: int) -> dict[str, list[str]]:
    pd = [f"prefill=pp{n}", f"decode=tp{n}", "drafter=dspark"]
    return {
        "one process": ["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=none"],
        right_cut(n): pd,
        wrong_cut(n): [*pd, "transfer.force_page_ignorant_cut=[draft]"],
        f"P/D TP{n}->TP{n} dspark": [f"prefill=tp{n}", f"decode=tp{n}", "drafter=dspark"],
    }


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """The deployment and task options this script shares with bench_kv_fp8.py."""
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=4, help="n of PPn -> TPn (ranks per instance)")
    p.add_argument("--n", type=int, default=200, help="held-out arithmetic problems")
    p.add_argument("--k-shot", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=320, help="arithmetic answer budget")
    p.add_argument("--per-depth", type=int, default=10, help="retrieval facts per depth")
    p.add_argument("--context-len", type=int, help="haystack tokens (default: max_model_len less the answer)")
    p.add_argument("--transfer", help="transfer config (default: nccl on cuda, mooncake_tcp on cpu)")
    p.add_argument("--memory", type=float, default=0.2, help="share of one GPU per instance (cuda)")
    p.add_argument("--seed", type=int, default=0)


def default_transfer(args: argparse.Namespace) -> argparse.Namespace:
    args.transfer = args.transfer or ("nccl" if args.device == "cuda" else "mooncake_tcp")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(p)
    p.add_argument("--rows", help="comma-separated row names to run (default: all)")
    p.add_argument("--mlflow", help="MLflow tracking URI: the table as a parent run, a child per row")
    p.add_argument("--out", help="folder: the table (markdown) and the raw numbers (JSON)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every deployment")
    return default_transfer(p.parse_args(argv))


def run_workload(d, workload, requests) -> tuple[dict, list]:
    """Submits every request, scores what came back; returns (task metrics, outputs)."""
    from pdflow import SamplingParams
    from pdflow.bench.workloads.base import RequestResult

    first = requests[0]
    params = SamplingParams(temperature=0.0, max_tokens=first.max_tokens, stop=list(first.stop))
    outs = d.generate([q.prompt for q in requests], params)
    results = [RequestResult(ok=o.finish_reason != "error", text=o.text, error=o.error,
                             finish_reason=o.finish_reason, prompt_tokens=len(o.prompt_token_ids),
                             completion_tokens=len(o.token_ids)) for o in outs]
    metrics, _ = workload.score(requests, results)
    return metrics, outs


def run_tasks(d, args) -> dict:
    """Arithmetic then retrieval on a running deployment: each task's metrics and outputs,
    and the haystack length used."""
    from pdflow.bench.workloads.tasks import NEEDLE_MAX_TOKENS, ArithWorkload, NeedleWorkload
    from pdflow.spec import WorkloadSpec

    arith = ArithWorkload(WorkloadSpec(kind="arith", num_requests=args.n, k_shot=args.k_shot, seed=1234,
                                       max_tokens=args.max_tokens, context_len=2048))
    context = args.context_len or d.max_model_len - NEEDLE_MAX_TOKENS
    needle = NeedleWorkload(WorkloadSpec(kind="needle", num_requests=args.per_depth, context_len=context,
                                         seed=1234))
    arith_metrics, arith_outs = run_workload(d, arith, arith.requests())
    needle_metrics, needle_outs = run_workload(d, needle, needle.requests())
    return dict(arith=arith_metrics, arith_outs=arith_outs, needle=needle_metrics, needle_outs=needle_outs,
                context_len=context)


def measure(overrides: list[str], args) -> dict:
    """One row: arithmetic then retrieval on one deployment."""
    from pdflow import Deployment, compose

    start = time.perf_counter()
    with Deployment(compose(overrides)) as d:
        up = time.perf_counter()
        ran = run_tasks(d, args)
        leaked = {role: e.num_kv_blocks - d.free_kv_blocks()[role]
                  for role, e in (("prefill", d.producer), ("decode", d.consumer)) if e is not None}
    arith_outs, needle_outs = ran["arith_outs"], ran["needle_outs"]
    drafted = sum(o.num_drafted for o in arith_outs)
    accepted = sum(o.num_accepted for o in arith_outs)
    steps = sum(o.num_verify_steps for o in arith_outs)
    return dict(
        arith=ran["arith"], needle=ran["needle"], context_len=ran["context_len"],
        acceptance=accepted / drafted if drafted else None,
        tokens_per_forward=(accepted + steps) / steps if steps else None, drafted=drafted,
        tokens=[o.token_ids for o in arith_outs + needle_outs],
        errors=[o.error for o in arith_outs + needle_outs if o.error][:3],
        blocks_held_after=leaked, startup_s=up - start, wall_s=time.perf_counter() - up)


def rows_of(args, model: list[str]) -> list[dict]:
    from bench_gpu_pd import device_overrides, soft

    base = [*model, *device_overrides(args), *args.overrides]
    wanted = set(r.strip() for r in args.rows.split(",")) if args.rows else None
    if wanted is not None and wanted - set(layouts(args.gpus)):
        raise SystemExit(f"unknown rows {sorted(wanted - set(layouts(args.gpus)))}; "
                         f"choose from {list(layouts(args.gpus))}")
    out = []
    for name, extra in layouts(args.gpus).items():
        if wanted is not None and name not in wanted and name != "one process":
            continue
        res = soft(lambda e=extra: measure([*base, *e], args))
        out.append(dict(res, name=name, overrides=extra))
    ref = out[0].get("tokens")
    for r in out:
        toks = r.pop("tokens", None)
        if ref is not None and toks is not None:
            r["identical"] = sum(a == b for a, b in zip(toks, ref, strict=True))
            r["requests"] = len(ref)
    return out


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def table(args, rows: list[dict]) -> str:
    depths = next((sorted(k for k in r["needle"] if k.startswith("needle_accuracy_depth")) for r in rows
                   if "needle" in r), [])
    context = next((r["context_len"] for r in rows if "context_len" in r), "?")
    head = ["layout", "strict", "flexible", "acceptance", "tokens/forward", "same tokens as one process",
            f"retrieval ({context} tokens)", *[d.removeprefix("needle_accuracy_depth_") for d in depths],
            "blocks held after"]
    lines = [f"{args.n} held-out {args.k_shot}-shot arithmetic problems (greedy, up to {args.max_tokens} tokens) "
             f"and {args.per_depth} retrieval facts at each depth; acceptance over the arithmetic requests "
             f"(k = the drafter's num_speculative_tokens)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | FAILED: {r['error']} |" + " |" * (len(head) - 2))
            continue
        cells = [r["name"], fmt(r["arith"]["arith_strict"]), fmt(r["arith"]["arith_flexible"]),
                 fmt(r["acceptance"]), fmt(r["tokens_per_forward"], ".2f"), f"{r['identical']}/{r['requests']}" if "identical" in r else "- (no reference)",
                 fmt(r["needle"]["needle_accuracy"], ".2f"), *[fmt(r["needle"][d], ".2f") for d in depths],
                 json.dumps(r["blocks_held_after"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + verdicts(args, rows))


def verdicts(args, rows: list[dict]) -> list[str]:
    """What the table says about the cut: the forced wrong draft cut must keep the target's
    tokens (its KV is exact) and lose acceptance against the right cut of the same layout."""
    by = {r["name"]: r for r in rows if "error" not in r}
    right, wrong = by.get(right_cut(args.gpus)), by.get(wrong_cut(args.gpus))
    if not right or not wrong or right["acceptance"] is None or wrong["acceptance"] is None or "identical" not in wrong:
        return []
    caught = wrong["acceptance"] < right["acceptance"] - 0.02
    return ["", f"page-ignorant draft cut: acceptance {wrong['acceptance']:.3f} against {right['acceptance']:.3f} "
                f"with the right cut, {wrong['identical']}/{wrong['requests']} requests' tokens unchanged: "
                + ("caught (acceptance drops, outputs do not)" if caught else "NOT caught")]


def main(argv=None) -> int:
    from bench_engine import git_commit
    from bench_gpu_pd import command_line, hardware, publish

    args = parse_args(argv)
    rows = rows_of(args, ["model=tiny"])
    command = command_line(argv)
    header = (f"bench_gpu_accuracy on {hardware(args.device)}, commit {git_commit()}, model tiny, "
              f"transfer={args.transfer}\ncommand: {command}")
    text = f"{header}\n\n{table(args, rows)}\n"
    publish(args, name="accuracy", title=f"accuracy PP{args.gpus}->TP{args.gpus}", command=command, text=text,
            results=rows, rows=rows)
    return 1 if any("error" in r for r in rows) else 0

if __name__ == "__main__":
    sys.exit(main())
