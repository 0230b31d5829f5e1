#!/usr/bin/env python
"""The Mooncake mover the engine runs: packed staging vs direct writes, through ``Deployment``.

``transfer=mooncake_tcp`` with ``transfer.staging=true`` (each request's cut runs packed
per consumer rank, one Mooncake write per chunk into the consumer's registered host
staging, scattered there: the ``mooncake`` mover of ``transfer/p2p.py``) against
``staging=false`` (Mooncake writes every cut run straight into the consumer's registered
caches: ``worker/kv_link.py``'s direct path). The same P/D deployment of the shipped tiny
model otherwise (TP1 prefill -> TP2 decode: a head cut), prompts long enough that the
transfer matters, a few decode tokens each. Runs alternate, staged first; prints req/s
of each, the ratio direct / staged, and checks both produced the same tokens.

    python scripts/bench_pd_mover.py                    # page 16, 16 prompts of 512 tokens
    python scripts/bench_pd_mover.py --page 128 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", type=int, default=16, help="kv_page_tokens on both sides")
    p.add_argument("--prefill", default="tp1")
    p.add_argument("--decode", default="tp2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per mover")
    return p.parse_args()


def make(args, staging: bool):
    from pdflow import Deployment, compose

    blocks = args.prompts * (-(-(args.prompt_len + args.max_tokens) // 128) + 1)
    return Deployment(compose([
        "drafter=none", "tracking=off", "transfer=mooncake_tcp", f"transfer.staging={str(staging).lower()}",
        f"prefill={args.prefill}", f"decode={args.decode}", "prefill.block_size=128", "decode.block_size=128",
        f"prefill.kv_page_tokens={args.page}", f"decode.kv_page_tokens={args.page}",
        f"prefill.num_kv_blocks={blocks}", f"decode.num_kv_blocks={blocks}",
        "prefill.enable_prefix_caching=false", "decode.enable_prefix_caching=false",
    ]))


def timed(deployment, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from pdflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    began = time.perf_counter()
    outs = deployment.generate(prompts, params)
    seconds = time.perf_counter() - began
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return seconds, [o.token_ids for o in outs]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 120, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.prefill} -> {args.decode}, "
          f"page {args.page}, {args.prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} tokens each")
    movers = {"staged": True, "direct": False}
    deployments = {name: make(args, staging) for name, staging in movers.items()}
    seconds: dict[str, list[float]] = {name: [] for name in movers}
    tokens = {}
    try:
        for d in deployments.values():  # warm: first steps, pairs connected
            timed(d, prompts[:2], args.max_tokens)
        for r in range(args.repeats):
            for name, d in deployments.items():
                secs, tokens[name] = timed(d, prompts, args.max_tokens)
                seconds[name].append(secs)
                print(f"  run {r}: {name:6s} {args.prompts / secs:6.2f} req/s", flush=True)
    finally:
        for d in deployments.values():
            d.shutdown()
    rate = {name: args.prompts / statistics.median(s) for name, s in seconds.items()}
    print(f"median req/s: staged {rate['staged']:.2f}, direct {rate['direct']:.2f}; "
          f"direct / staged = {rate['direct'] / rate['staged']:.2f}x; same tokens: {tokens['staged'] == tokens['direct']}")


if __name__ == "__main__":
    main()
