#!/usr/bin/env python
"""Where a decode step's time goes, with and without the drafter: mean step wall time,
host syncs are inside it, over a fixed batch on one instance, each step's path (prefill
tiles, decode, decode rows), whether a CUDA graph replayed it, the attention ops it ran
eagerly and the Triton kernels built while timed (should be 0), then the device time of
the step's CUDA graph alone (replayed back to back: what the GPU needs, against the step's
wall time: the rest is host work) and its kernels, then the top ops of a few steady steps
(torch.profiler). For reading, not a benchmark table.

    python scripts/profile_spec_step.py --device cuda --batch 1 --modes none,dspark-eager,dspark
"""

from __future__ import annotations

import argparse
import time

import torch

from pdflow import SamplingParams
from pdflow.bench.step_trace import StepTrace
from pdflow.bench.tasks import arith_eval_set
from pdflow.engine.llm import LLM
from pdflow.spec.load import compose_spec


def _llm(args, mode: str) -> LLM:
    kind = mode.split("-")[0]
    over = ["mode=monolithic", "prefill=tp1", "decode=tp1", "tracking=off", f"drafter={kind}",
            f"prefill.device={args.device}", f"decode.device={args.device}",
            f"decode.max_num_seqs={args.batch}", f"decode.enforce_eager={mode.endswith('-eager')}",
            "decode.overlap_scheduling=false", *args.overrides]  # StepTrace times whole steps
    return LLM.from_run_spec(compose_spec(over), role="decode")


def graph_time(engine, args) -> None:
    """The last step's CUDA graph replayed back to back (same inputs: it rewrites the
    same KV slots with the same values): device ms per replay, and its top kernels."""
    if args.device != "cuda":
        return
    stage = engine.instance.executor.stage
    runner = stage.drafted_graphs if stage.drafted_graphs is not None else stage.graphs
    if runner is None or not runner.captured.graphs:
        return
    bucket = min(runner.captured.graphs)  # batch 1: bucket 1; else the smallest holding the batch
    bucket = next((b for b in sorted(runner.captured.graphs) if b >= args.batch), bucket)
    graphs = runner.captured
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(bucket)
    torch.cuda.synchronize()
    start.record()
    for _ in range(50):
        graphs.replay(bucket)
    end.record()
    end.synchronize()
    print(f"{type(runner).__name__} bucket {bucket}: {start.elapsed_time(end) / 50:.3f} ms of device time "
          f"per replay (back to back)", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs.replay(bucket)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--modes", default="none,dspark-eager,dspark")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--show-steps", type=int, default=12, help="per-step lines printed per mode")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. model.dtype=bf16)")
    args = parser.parse_args()
    prompts = [it.prompt for it in arith_eval_set(args.batch, k_shot=5, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for mode in args.modes.split(","):
        with _llm(args, mode) as llm:
            # Twice: whole prompts, then the prefix-hit tails the timed run takes.
            for _ in range(2):
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
            engine = llm.engine
            with StepTrace(engine) as trace:
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - start
            steps = len(trace.records)
            tokens = sum(len(o.token_ids) for o in outs)
            steady = [r.ms for r in trace.records[1:]]  # past the prefix-hit tail
            print(f"## {mode} batch {args.batch}: {steps} steps, {1e3 * elapsed / steps:.2f} ms/step, "
                  f"{tokens / elapsed:.0f} tok/s; steps after the first: "
                  f"{sum(steady) / max(len(steady), 1):.2f} ms mean", flush=True)
            print(trace.summary())
            for rec in trace.records[: args.show_steps]:
                print("  " + rec.line())
            graph_time(engine, args)
            # The window holds one prefix-hit tail step per request, then 16-token decodes.
            acts = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            print(prof.key_averages().table(sort_by="self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total", row_limit=args.top), flush=True)


if __name__ == "__main__":
    main()
