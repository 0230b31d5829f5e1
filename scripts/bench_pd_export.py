#!/usr/bin/env python
"""Prefill throughput with KV export vs without, in one run: the transfer off the forward.

One P/D deployment (PP2 prefill -> TP1 decode by default, the tiny model, the spec's
default transfer). Its prefill instance runs the same prefill-only prompts
(``max_tokens=1``) twice per round: alone (no KV target: the baseline), then as P/D
prefills whose KV goes into blocks the decode instance allocated for them, each done once
its KV has settled (landed in the decode instance). Prints prompt tokens/s of each and
the ratio, the median of the rounds' ratios (issue 29 asks >= 0.9x), and checks both
sampled the same first tokens and every block came back. It runs on the code before
issue 29 too (its synchronous export), for the before/after figure.

    python scripts/bench_pd_export.py                     # CPU: PP2 -> TP1, 8 x 1024 tokens, 7 rounds
    python scripts/bench_pd_export.py --device cuda --prefill tp1 --decode tp1 \\
        --set transfer=nccl --prompts 64 --prompt-len 2048   # one GPU, both instances in process
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", default="pp2")
    p.add_argument("--decode", default="tp1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7, help="rounds, each the baseline then the export")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="*", default=[], help="more spec overrides (transfer=nccl, ...)")
    return p.parse_args()


def overrides(args) -> list[str]:
    blocks = args.prompts * (-(-args.prompt_len // 128) + 1) + 8
    out = [f"prefill={args.prefill}", f"decode={args.decode}", "drafter=none", "tracking=off"]
    for r in ("prefill", "decode"):
        out += [f"{r}.block_size=128", f"{r}.kv_page_tokens=128", f"{r}.num_kv_blocks={blocks}",
                f"{r}.max_num_batched_tokens={args.prompt_len}", f"{r}.enable_prefix_caching=false",
                f"{r}.device={args.device}"]
    if args.device == "cuda":
        out += ["prefill.device_offset=0", "decode.device_offset=0", "prefill.device_memory_gib=140",
                "decode.device_memory_gib=140", "prefill.memory=0.1", "decode.memory=0.1"]
    return [*out, *args.set]


def prefill_alone(d, prompts, params) -> list[int]:
    """The prefill instance serves the prompts itself: no KV target, nothing exported."""
    engine = d.producer
    ids = [engine.add_request(p, params, f"alone{i}") for i, p in enumerate(prompts)]
    first = {}
    while engine.has_unfinished():
        first.update((o.request_id, o.token_id) for o in engine.step())
    return [first[i] for i in ids]


def prefill_exporting(d, prompts, params) -> list[int]:
    """P/D prefills: each prompt's KV goes into blocks the decode instance allocated; done
    when every one has settled (then the decode side lets the blocks go)."""
    from pdflow.engine.sequence import KVTarget

    producer, consumer = d.producer, d.consumer
    ids = []
    for i, p in enumerate(prompts):
        rid = f"pd{i}"
        blocks = consumer.add_remote_request(p, params, rid)
        if blocks is None:
            raise SystemExit("the decode pool is too small for every prompt at once; raise num_kv_blocks")
        producer.add_request(p, params, rid, kv_target=KVTarget(blocks=tuple(blocks), nonce=consumer.instance.kv_nonce(blocks)))
        ids.append(rid)
    first = {}
    legacy = getattr(producer, "export_results", None)  # the code before issue 29, for "before"
    while producer.has_unfinished():
        for out in producer.step():
            error = legacy.pop(out.request_id, None) if legacy is not None else out.kv_error
            if error is not None:
                raise SystemExit(f"{out.request_id}: KV transfer failed: {error}")
            first[out.request_id] = out.token_id
    for rid in ids:
        consumer.fail_remote(rid, "abort")  # measured: only the prefill side's throughput
    return [first[i] for i in ids]


def main() -> None:
    args = parse_args()
    from pdflow import Deployment, SamplingParams, compose

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(4, 128, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runs = {"without export": prefill_alone, "with KV export": prefill_exporting}
    times: dict[str, list[float]] = {name: [] for name in runs}
    firsts = {}
    spec = compose(overrides(args))
    with Deployment(spec) as d:
        for run in runs.values():  # warm-up: first-step allocations, pairs' first use
            run(d, prompts[:2], params)
        for _ in range(args.repeats):
            for name, run in runs.items():
                began = time.perf_counter()
                firsts[name] = run(d, prompts, params)
                times[name].append(time.perf_counter() - began)
        pools = [(e.num_free_kv_blocks, e.num_kv_blocks) for e in (d.producer, d.consumer)]
        staged = spec.transfer.backend == "mooncake" and spec.transfer.staging
        mover = spec.transfer.backend + (" staging" if staged else "")
    tokens = args.prompts * args.prompt_len
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    # Each round's two runs are next to each other in time: their ratio sees the same load
    # (this machine may be shared), so the median of the rounds' ratios is the figure.
    paired = statistics.median(b / e for b, e in zip(times["without export"], times["with KV export"], strict=True))
    print(f"prefill={args.prefill} -> decode={args.decode} on {args.device}, transfer {mover}: "
          f"{args.prompts} prompts x {args.prompt_len} tokens, {args.repeats} alternating rounds")
    for name, rate in rates.items():
        print(f"  {name:16s} {rate:10.0f} prompt tok/s  (rounds: {', '.join(f'{t:.2f}s' for t in times[name])})")
    print(f"  ratio with/without export: {paired:.2f}x, median of the rounds' ratios "
          f"({rates['with KV export'] / rates['without export']:.2f}x of the median rates; goal >= 0.9x)")
    print(f"  same first tokens: {firsts['with KV export'] == firsts['without export']}; "
          f"every block back: {all(free == total for free, total in pools)}")


if __name__ == "__main__":
    main()
