#!/usr/bin/env python
"""The Mooncake mover the engine runs: packed staging vs direct writes, through ``Deployment``.

``transfer=mooncake_tcp`` with ``transfer.staging=true`` (each request's cut runs packed
per consumer rank, one Mooncake write per chunk into the consumer's registered host
staging, scattered there: the ``mooncake`` mover, ``transfer/movers/staged_mooncake.py``) against
``staging=false`` (Mooncake writes every cut run straight into the consumer's registered
caches: ``worker/kv_link.py``'s direct path). Two measures, each alternating staged and
direct in one run:

- links: the transfer alone, through the ranks' own ``KVLink``s in one process (a TP1
  producer rank's ``export`` into both TP2 consumer ranks, paired as the engine pairs
  them, the consumer's grant checked): median seconds per request of ``--prompt-len``
  tokens, and GB/s of cache bytes moved.
- deployment: the same P/D deployment of the shipped tiny model end to end (TP1 prefill
  -> TP2 decode), a few decode tokens per prompt: req/s, and both movers' tokens equal.

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
    p.add_argument("--links-only", action="store_true", help="skip the end-to-end deployment runs")
    return p.parse_args()


def make(args, staging: bool, build: bool = True):
    from pdflow import Deployment, compose
    from pdflow.graph import build_graph

    blocks = args.prompts * (-(-(args.prompt_len + args.max_tokens) // 128) + 1)
    spec = compose([
        "drafter=none", "tracking=off", "transfer=mooncake_tcp", f"transfer.staging={str(staging).lower()}",
        f"prefill={args.prefill}", f"decode={args.decode}", "prefill.block_size=128", "decode.block_size=128",
        f"prefill.kv_page_tokens={args.page}", f"decode.kv_page_tokens={args.page}",
        f"prefill.num_kv_blocks={blocks}", f"decode.num_kv_blocks={blocks}",
        "prefill.enable_prefix_caching=false", "decode.enable_prefix_caching=false",
    ])
    return Deployment(spec) if build else build_graph(spec)


def link_seconds(args, staging: bool, reps: int) -> tuple[float, int]:
    """(median seconds per exported request, cache bytes each moves) through KVLinks."""
    from pdflow.attention.kv_cache import TORCH_DTYPES
    from pdflow.graph import CONSUMER, PRODUCER
    from pdflow.parallel.messages import KVExport
    from pdflow.transfer.grants import kv_nonce, new_key
    from pdflow.worker.kv_link import KVLink

    graph = make(args, staging, build=False)
    blocks = -(-args.prompt_len // 128)
    num = 2 * blocks

    def caches(units):
        return {u.name: torch.randn(u.cache_shape(num)).to(TORCH_DTYPES[u.dtype]) for u in units}

    key = new_key()
    consumers = [KVLink(graph, CONSUMER, r.rank, caches(r.units)) for r in graph.consumer.ranks]
    producer = KVLink(graph, PRODUCER, 0, caches(graph.rank(PRODUCER, 0).units))
    try:
        producer.pair([c.open(key) for c in consumers])
        seconds = []
        for i in range(reps + 1):  # the first connects Mooncake's segments: not timed
            src, dst = list(range(blocks)), list(range(num - 1, num - 1 - blocks, -1))
            began = time.perf_counter()
            job = KVExport(request_id=f"r{i}", nonce=kv_nonce(key, dst), src_blocks=src, dst_blocks=dst)
            for consumer_rank in producer.consumer_ranks:  # one after another: the link alone
                producer.send(consumer_rank, job)
            seconds.append(time.perf_counter() - began)
        moved = sum(u.bytes_per_block for u in graph.rank(PRODUCER, 0).units) * blocks
        return statistics.median(seconds[1:]), moved
    finally:
        for link in (producer, *consumers):
            link.close()


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
    per_request: dict[str, list[float]] = {name: [] for name in movers}
    for _ in range(args.repeats):
        for name, staging in movers.items():
            secs, moved = link_seconds(args, staging, reps=5)
            per_request[name].append(secs)
            print(f"  links {name:6s} {secs * 1e3:8.1f} ms per request ({moved / secs / 1e9:.3f} GB/s)", flush=True)
    link = {name: statistics.median(s) for name, s in per_request.items()}
    print(f"links, median ms per request: staged {link['staged'] * 1e3:.1f}, direct {link['direct'] * 1e3:.1f}; "
          f"staged / direct speed = {link['direct'] / link['staged']:.2f}x", flush=True)
    if args.links_only:
        return
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
