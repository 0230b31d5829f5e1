"""Estimate vs measured: prefill tok/s and decode tok/s per deployment, and the fraction
of points within +-25% (issue 32's acceptance: >= 80%).

Each point is a deployment (Hydra overrides) served like ``pdflow run`` serves it; two
workloads measure it: ``prefill`` (``--prompt`` tokens, ``--concurrency`` at a time, one
output token: prompt tokens/s) and ``serve`` with fixed lengths (16-token prompts,
``--output`` tokens each, ``--concurrency`` at once: decode tokens/s = concurrency /
mean time per output token), each once in a fresh server and then ``--repeats`` times more
with other prompts: the median of the repeats is compared, their range and the first run
shown beside it. The estimate prices the same graph with the machine
profile, measured at the start of this run unless ``--profile FILE`` is given.

  python scripts/bench_estimate.py                       # CPU, tiny model, the CPU points
  python scripts/bench_estimate.py --points gpu --device cuda   # one H200 (see bench/RESULTS.md)
  python scripts/bench_estimate.py --points gpu --profile P --measured M.json   # a new profile, the same runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

POINTS = {
    "cpu": [
        ["mode=monolithic", "decode=tp1"],
        ["mode=monolithic", "decode=tp2"],
        ["mode=monolithic", "decode=tp1", "decode.pp=2", "decode.layer_partition=[4,4]"],
        ["mode=monolithic", "decode=tp4"],
        ["prefill=tp1", "decode=tp1"],
        ["prefill=pp2", "decode=tp2"],
        ["prefill=tp2", "decode=tp2"],
        ["prefill=pp4", "decode=tp4"],
    ],
    "gpu": [
        [f"model={m}", "model.path=null", "mode=monolithic", "decode=tp1", "decode.device=cuda",
         "prefill.device=cuda"] for m in ("qwen3-0.6b", "llama3-8b")
    ] + [
        [f"model={m}", "model.path=null", "prefill=tp1", "decode=tp1", "decode.device=cuda", "prefill.device=cuda",
         "decode.device_offset=0"] for m in ("qwen3-0.6b", "llama3-8b")
    ],
}
COMMON = ["drafter=none", "tracking=off", "workload.progress=false"]


def measure_point(overrides: list[str], args) -> dict:
    """Serve the deployment once per workload (a fresh process: nothing cached between);
    in it, the workload once (``first``: a fresh server, what one run measures) and then
    ``--repeats`` more times with other prompts (the workload's seed + i, so the prefix
    cache serves none of them): each figure is their median, with their min and max."""
    code = f"""
import dataclasses, json, statistics, sys
from pdflow.bench.workloads import Target, build_workloads, prepare, run_workloads_sync
from pdflow.serve.launch import serve_spec
from pdflow.spec.load import compose_spec
out = {{}}
def figure(name, result):
    if name == "prefill":
        return result.metrics["prompt_throughput_tok_s"]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in result.rows
            if r["ok"] and r["completion_tokens"] > 1]
    return len(tpot) / (sum(tpot) / len(tpot)) if tpot else float("nan")
for name, extra in (("prefill", ["workload=prefill", "workload.num_requests={args.requests}",
                                 "workload.prompt_tokens={args.prompt}", "workload.concurrency={args.concurrency}"]),
                    ("decode", ["workload=serve", "workload.num_requests={args.concurrency}",
                                "workload.concurrency={args.concurrency}", "workload.input_len=[16,16]",
                                "workload.output_len=[{args.output},{args.output}]"])):
    spec = compose_spec(sys.argv[1:] + extra)
    got = []
    with serve_spec(spec, port=0) as served:
        target = Target(url=served.url, model=served.model_name, api_key=served.api_key)
        for i in range({args.repeats} + 1):
            work = dataclasses.replace(spec.workload, seed=spec.workload.seed + i)
            got.append(figure(name, run_workloads_sync(target, prepare(build_workloads(work, vocab=spec.model.vocab)),
                                                       work)))
    rest = got[1:] or got
    out[name + "_tok_s"] = statistics.median(rest)
    out[name + "_runs"] = got
print("RESULT " + json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code, *COMMON, *overrides], capture_output=True, text=True,
                          timeout=args.timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (done.stderr or done.stdout)[-400:]}
    return json.loads(line[len("RESULT "):])


def spread(got: dict, key: str) -> str:
    """The repeats' range (the fresh server's first run apart), as min-max."""
    runs = got.get(key.replace("_tok_s", "_runs"), [])[1:]
    return f"{min(runs):.4g}-{max(runs):.4g}" if runs else "-"


def estimate_point(overrides: list[str], profile, args) -> dict:
    from pdflow.bench.estimate import Pricer, tokens_per_forward
    from pdflow.graph import CONSUMER, PRODUCER, build_graph
    from pdflow.spec.load import compose_spec

    graph = build_graph(compose_spec([*COMMON, *overrides]))
    role = CONSUMER if graph.producer is None else PRODUCER
    _, prefill = Pricer(graph=graph, profile=profile, role=role).prefill(args.prompt, args.concurrency)
    step = Pricer(graph=graph, profile=profile, role=CONSUMER).step_s(args.concurrency, 16 + args.output // 2,
                                                                       args.concurrency, stream=True)
    depth = Pricer(graph=graph, profile=profile, role=CONSUMER).depth(args.concurrency)
    return {"prefill_tok_s": prefill, "decode_tok_s": args.concurrency * tokens_per_forward(graph) * depth / step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="cpu", choices=sorted(POINTS))
    parser.add_argument("--only", default=None, help="comma-separated point numbers (from 0)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", default=None, help="a saved profile (default: measure one now)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5,
                        help="times each workload runs after its first in the same server (the median is compared)")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--save", default=None, help="write what was measured here (JSON, by point number)")
    parser.add_argument("--measured", default=None,
                        help="compare against a --save file instead of serving again (a new profile, same points)")
    args = parser.parse_args()
    from pdflow.bench.profile import MachineProfile, measure
    from pdflow.serve.step_probe import served_probe

    models = tuple(dict.fromkeys(o.split("=", 1)[1] for point in POINTS[args.points] for o in point
                                 if o.startswith("model=")))
    profile = (MachineProfile.load(Path(args.profile)) if args.profile
               else measure(args.device, served_probe, models=models))
    points = POINTS[args.points]
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(points))
    print("| point | prefill tok/s est | measured (median) | spread | first | est/meas | decode tok/s est | "
          "measured (median) | spread | first | est/meas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    within, within_first, total = 0, 0, 0
    measured, saved = json.loads(Path(args.measured).read_text()) if args.measured else {}, {}
    for i in chosen:
        overrides = points[i]
        est = estimate_point(overrides, profile, args)
        got = measured[str(i)] if args.measured else measure_point(overrides, args)
        saved[str(i)] = got
        if args.save:
            Path(args.save).write_text(json.dumps(saved, indent=1))
        if "error" in got:
            print(f"| {' '.join(overrides)} | failed: {got['error']!r} |", flush=True)
            continue
        cells = []
        for key in ("prefill_tok_s", "decode_tok_s"):
            ratio = est[key] / got[key]
            within += abs(ratio - 1) <= 0.25
            total += 1
            first = got.get(key.replace("_tok_s", "_runs"), [got[key]])[0]
            within_first += abs(est[key] / first - 1) <= 0.25
            cells += [f"{est[key]:.4g}", f"{got[key]:.4g}", spread(got, key), f"{first:.4g}", f"{ratio:.2f}"]
        print(f"| {' '.join(overrides)} | " + " | ".join(cells) + " |", flush=True)
    tables = ", ".join(t.model for t in profile.step_tables) or "none: priced by the GEMM rate"
    print(f"\nwithin +-25%: {within}/{total} = {within / max(1, total):.0%} "
          f"(profile v{profile.version}: step tables {tables}; step overhead {profile.table_step_overhead_s * 1e3:.3g} "
          f"ms vs table (GEMM model: {profile.step_overhead_s * 1e3:.3g}), row {profile.table_row_overhead_s * 1e3:.3g} ms, "
          f"rank step "
          f"{profile.table_rank_step_overhead_s * 1e3:.3g} ms, request {profile.request_overhead_s * 1e3:.3g} ms, "
          f"GEMM {profile.gemm_flops_s / 1e9:.3g} GFLOP/s, {profile.cores} cores)")
    print(f"against each point's first run alone (a fresh server): {within_first}/{total}")
    ms = {k: round(v * 1e3, 2) for k, v in profile.table_rank_step_by_layout.items()}
    us = {k: round(v * 1e6, 2) for k, v in profile.rank_prefill_token_s_by_layout.items()}
    print(f"rank step by layout (ms): {ms}; prefill cost a token by layout (us): {us}; P/D exchange "
          f"{profile.exchange_request_s * 1e3:.3g} ms a request + {profile.exchange_token_s * 1e6:.3g} us a token; by "
          f"KV rank pairs (ms): { {k: round(v * 1e3, 2) for k, v in profile.exchange_request_by_pairs.items()} }")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
