#!/usr/bin/env python
"""Speculative decoding on the shipped tiny model: acceptance and tokens per forward per
drafter and layout over held-out arithmetic problems, then decode speed with and without
the drafter at several batch sizes (ratio against the no-drafter run of the same batch).

The drafter weights are the ones shipped next to the model (pdflow/assets/tiny-<kind>)
when present, else random (acceptance ~0; the table says which).

    python scripts/bench_spec_decode.py --n 200 --device cuda                      # H200
    python scripts/bench_spec_decode.py --n 2 --max-tokens 16 --layouts single \\
        --batches 1 --speed-tokens 16 --device cpu                                  # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

import torch

from pdflow import Deployment, SamplingParams, compose
from pdflow.bench.step_trace import StepTrace
from pdflow.bench.tasks import arith_eval_set
from pdflow.graph import GraphRefused
from pdflow.worker.drafter_build import drafter_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import git_commit  # noqa: E402  (scripts/ sits beside this file)

LAYOUTS = {
    "single": ["mode=monolithic", "prefill=tp1", "decode=tp1"],
    "pp4->tp4": ["prefill=pp4", "decode=tp4"],
    "tp4->tp4": ["prefill=tp4", "decode=tp4"],
}


def _base(args, kind: str) -> list[str]:
    out = [f"drafter={kind}", "tracking=off", f"prefill.device={args.device}", f"decode.device={args.device}",
           *args.overrides]
    if kind != "none":
        out.append(f"drafter.num_speculative_tokens={args.k}")
    return out


def greedy(args, spec, prompts: list[str]):
    with Deployment(spec) as d:
        return d.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))


def acceptance(args, kind: str, layout: str, prompts: list[str], reference: list[list[int]]) -> str:
    """One row; ``reference`` is one process's greedy tokens without a drafter."""
    try:
        spec = compose([*_base(args, kind), *LAYOUTS[layout]])
        outs = greedy(args, spec, prompts)
    except GraphRefused as err:
        return f"| {kind} | {layout} | refused: {', '.join(sorted(r.code.value for r in err.refusals))} | | | | |"
    errors = [o.error for o in outs if o.error]
    if errors:
        return f"| {kind} | {layout} | {len(errors)} requests failed: {errors[0][:80]} | | | | |"
    differ = sum(o.token_ids != ref for o, ref in zip(outs, reference, strict=True))
    lossless = "yes" if not differ else f"NO: {differ} of {len(outs)} differ"
    drafted = sum(o.num_drafted for o in outs)
    accepted = sum(o.num_accepted for o in outs)
    steps = sum(o.num_verify_steps for o in outs)
    weights = drafter_checkpoint(spec)
    rate = accepted / drafted if drafted else 0.0
    tpf = (accepted + steps) / steps if steps else 0.0
    return (f"| {kind} | {layout} | {rate:.3f} | {tpf:.2f} | {drafted} | {lossless} | "
            f"{weights.name if weights else 'random'} |")


def speed(args, kind: str, batch: int, prompts: list[str], extra: tuple[str, ...] = ()) -> tuple[float, str, str]:
    """Output tokens per second of a batch decoding ``speed_tokens`` each (EOS ignored),
    the median of ``args.repeats`` timed runs of one warm instance (a short run on a
    shared host swings; the range goes into the trace line), how many of the first timed
    run's drafted steps ran whole as a captured graph ("m/n"), and what its steps did
    (paths, graphed, kernels built, slowest step)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.speed_tokens, ignore_eos=True)
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    overrides = [*_base(args, kind), *LAYOUTS["single"], f"decode.max_num_seqs={max(batch, 1)}", *extra]
    with Deployment(compose(overrides)) as d:
        # Warm every path the timed run takes, so no kernel compiles or graph captures
        # inside the timing: the timed workload itself, twice (the first prefills whole
        # prompts, the second hits the prefix cache and prefills each prompt's tail, as
        # the timed run does, through every context length and batch shape it reaches:
        # Triton specialises integer arguments, so a shape the warm-up missed compiles).
        for _ in range(2):
            d.generate(chosen, params)
        # StepTrace times whole steps: an overlap-scheduled instance (no drafter, one GPU)
        # runs untraced, as it serves.
        overlap = getattr(d.consumer.instance.executor, "overlap", False)
        rates, trace = [], None
        for i in range(max(1, args.repeats)):
            traced = not overlap and i == 0  # the first timed run's steps, traced
            with StepTrace(d.consumer) if traced else contextlib.nullcontext() as tracing:
                start = time.perf_counter()
                outs = d.generate(chosen, params)
                elapsed = time.perf_counter() - start
            trace = tracing if traced else trace
            rates.append(sum(len(o.token_ids) for o in outs) / elapsed)
    rate = statistics.median(rates)
    spread = f" (median of {len(rates)}: {min(rates):.0f}-{max(rates):.0f} tok/s)" if len(rates) > 1 else ""
    if trace is None:
        return rate, "-", f"- batch {batch} {kind}{spread}: overlap scheduling (steps not traced)"
    drafted = [r for r in trace.records if r.drafted]
    graphed = f"{sum(r.drafted_graph for r in drafted)}/{len(drafted)}"
    return rate, graphed, f"- batch {batch} {kind}{spread}: {trace.summary()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="held-out arithmetic problems")
    parser.add_argument("--k", type=int, default=7, help="drafts per step")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kinds", default="dspark,eagle,eagle3")
    parser.add_argument("--layouts", default="single,pp4->tp4,tp4->tp4")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--speed-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--speed-only", action="store_true", help="skip the acceptance table")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per instance after its warm-up; the table shows their median")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. model.dtype=bf16)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    prompts = [item.prompt for item in arith_eval_set(args.n)]
    print(f"{_hardware(args.device)}, torch {torch.__version__}, commit {git_commit() or '?'}, "
          f"{datetime.date.today()}; command: {' '.join(sys.argv)}")
    if not args.speed_only:
        acceptance_table(args, kinds, prompts)
    speed_table(args, kinds, prompts)


def _hardware(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "CPU"


def acceptance_table(args, kinds: list[str], prompts: list[str]) -> None:
    print(f"# acceptance at k={args.k}, {args.n} held-out arith problems, greedy, "
          f"max_tokens={args.max_tokens}, device={args.device}")
    reference = [o.token_ids for o in greedy(args, compose([*_base(args, "none"), *LAYOUTS["single"]]), prompts)]
    print("(lossless: the same greedy tokens as one process without a drafter)")
    print("| drafter | layout | acceptance | tokens/forward | drafted | lossless | weights |")
    print("|---|---|---|---|---|---|---|")
    for kind in kinds:
        for layout in args.layouts.split(","):
            print(acceptance(args, kind, layout, prompts, reference), flush=True)


def speed_table(args, kinds: list[str], prompts: list[str]) -> None:
    print(f"\n# decode output tokens/s, one instance, {args.speed_tokens} tokens per request, "
          f"median of {args.repeats} timed runs after the warm-up")
    print("(none: without a drafter, overlap scheduling on (auto) and off; each ratio is against the faster. "
          "Drafted graphs: the timed run's drafted steps that ran whole as one captured graph)")
    print("| batch | none, overlap | none, no overlap | " + " | ".join(f"{k} | {k}/none | {k} drafted graphs" for k in kinds)
          + " |")
    print("|---|---|---|" + "---|---|---|" * len(kinds))
    traces = []
    for batch in (int(b) for b in args.batches.split(",") if b):
        overlapped, _, trace = speed(args, "none", batch, prompts)
        traces.append(trace)
        plain, _, trace = speed(args, "none", batch, prompts, ("decode.overlap_scheduling=false",))
        traces.append(trace)
        base = max(overlapped, plain)
        cells = []
        for kind in kinds:
            rate, graphed, trace = speed(args, kind, batch, prompts)
            traces.append(trace)
            cells.append(f"{rate:.1f} | {rate / base:.2f}x | {graphed}")
        print(f"| {batch} | {overlapped:.1f} | {plain:.1f} | " + " | ".join(cells) + " |", flush=True)
    print("\n# the timed runs' steps (paths: stage_runner; a replayed graph calls no attention op)")
    print("\n".join(traces))


if __name__ == "__main__":
    main()
