#!/usr/bin/env python
"""Pipeline-parallel prefill throughput: steps in flight one per stage vs one at a time.

Prefill-only requests (``max_tokens=1``, the reference deployment's prefill table) through
one PP instance of the shipped model, the same instance spec twice in one run: with
``max_steps_in_flight=1`` (each step crosses every stage before the next starts) and with
the default (one step per stage in flight). Runs alternate, baseline first; prints prompt
tokens/s for each and the ratio, and checks both sampled the same first tokens.

    python scripts/bench_pp.py                        # PP2 on CPU, 24 prompts of 256 tokens
    python scripts/bench_pp.py --pp 4 --device cuda --prompts 64 --prompt-len 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per setting")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_llm(args, in_flight: int | None):
    from pdflow import LLM
    from pdflow.spec.load import compose_spec

    steps = "null" if in_flight is None else str(in_flight)
    spec = compose_spec([
        "drafter=none", f"decode.pp={args.pp}", "decode.tp=1", f"decode.device={args.device}",
        f"model.dtype={args.dtype}", "decode.block_size=128", "decode.kv_page_tokens=128",
        # One prompt per step, so the steps in flight are different requests.
        f"decode.max_num_batched_tokens={args.prompt_len}", f"decode.max_steps_in_flight={steps}",
        f"decode.num_kv_blocks={args.prompts * (-(-args.prompt_len // 128) + 1)}",
        "decode.enable_prefix_caching=false", "decode.device_offset=0",
    ])
    return LLM.from_run_spec(spec)


def timed_run(llm, prompts) -> tuple[float, list[int]]:
    from pdflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    began = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - began, [o.token_ids[0] for o in outs]


def main() -> None:
    args = parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(4, 100, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    llms = {"one step in flight": make_llm(args, 1), f"{args.pp} steps in flight": make_llm(args, None)}
    times: dict[str, list[float]] = {name: [] for name in llms}
    firsts = {}
    try:
        for llm in llms.values():  # warm-up (first-step allocations, kernel caches)
            timed_run(llm, prompts[:2])
        for _ in range(args.repeats):
            for name, llm in llms.items():
                secs, firsts[name] = timed_run(llm, prompts)
                times[name].append(secs)
        depth = {name: llm.instance.executor.max_in_flight for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()
    tokens = args.prompts * args.prompt_len
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"PP{args.pp} on {args.device} ({args.dtype}), {args.prompts} prompts x {args.prompt_len} "
          f"tokens, max_tokens 1, median of {args.repeats} alternating runs")
    for name, rate in rates.items():
        runs = ", ".join(f"{tokens / t:.0f}" for t in times[name])
        print(f"  {name:>20}: {rate:8.0f} prompt tok/s  (runs: {runs}; most in flight: {depth[name]})")
    base, piped = rates.values()
    print(f"  ratio: {piped / base:.2f}x")
    same = len(set(map(tuple, firsts.values()))) == 1
    print(f"  same first tokens: {same}")
    if not same:
        raise SystemExit("the two settings sampled different tokens")


if __name__ == "__main__":
    main()
