#!/usr/bin/env python
"""Where a prefill step's time goes: one prompt of ``--prompt-len`` ids (max_tokens 1) per
step on one instance: the step's wall time (host, synced) against its device time (CUDA
events around the forward), then the top ops by host time and by device time of a few
steps (torch.profiler). Under staggered serving every arrival costs such a step, so its
host share is what served throughput loses to offline waves. For reading, not a table.

    python scripts/profile_prefill_step.py --overrides model=qwen3-0.6b --prompt-len 512
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pdflow import SamplingParams
from pdflow.bench.workloads.load import random_token_ids
from pdflow.engine.llm import LLM
from pdflow.spec.load import compose_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--overrides", nargs="*", default=[])
    args = p.parse_args()
    spec = compose_spec(["mode=monolithic", "prefill=tp1", "decode=tp1", "tracking=off", "drafter=none",
                         f"prefill.device={args.device}", f"decode.device={args.device}",
                         "decode.enable_prefix_caching=false", "decode.overlap_scheduling=false", *args.overrides])
    llm = LLM.from_run_spec(spec, role="decode")
    rng = random.Random(0)
    sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = llm.engine.config.vocab_size

    def one_step() -> float:
        llm.submit([random_token_ids(rng, args.prompt_len, vocab) for _ in range(args.prompts)], sampling)
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.engine.step()
        sync()
        return time.perf_counter() - start

    for _ in range(3):
        one_step()
    walls = sorted(one_step() for _ in range(args.steps))
    print(f"{args.prompts} x {args.prompt_len} tokens per step: wall p50 {walls[len(walls) // 2] * 1e3:.2f} ms, "
          f"min {walls[0] * 1e3:.2f} ms", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if args.device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            one_step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    if args.device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
