#!/usr/bin/env python
"""HTTP serving vs the offline engine: the same LLM, prompts and output lengths (greedy,
EOS ignored), first through ``LLM.generate`` in waves of ``--concurrency`` prompts, then
through the OpenAI API (engine-loop thread, uvicorn, streamed SSE) with ``--concurrency``
clients. Over HTTP requests arrive staggered and batch differently than a wave does, so
the API's own overhead is the ratio at ``--concurrency 1`` (the default). The two alternate ``--repeats`` times (the best time of each counts, so a busy
machine hurts neither side more). Prints output tokens/s for both and their ratio.

    python scripts/bench_serve.py                      # shipped tiny model, CPU
    python scripts/bench_serve.py --requests 32 --concurrency 8 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pdflow:assets/tiny")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1, help="HTTP clients at once (offline: wave size)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    return p.parse_args()


def offline_waves(llm, prompts, sampling, wave: int) -> list:
    return [o for i in range(0, len(prompts), wave) for o in llm.generate(prompts[i:i + wave], sampling)]


def run_on_a_thread(fn):
    """``fn()`` and its seconds, on a fresh thread like the server's engine loop: torch's
    CPU thread pools behave differently on the main thread (much slower when the machine
    is oversubscribed), which would otherwise be measured instead of the API."""
    out = {}

    def body():
        start = time.perf_counter()
        out["value"] = fn()
        out["seconds"] = time.perf_counter() - start

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    return out["value"], out["seconds"]


def main() -> None:
    args = parse_args()
    from pdflow import LLM, SamplingParams
    from pdflow.bench.workloads import Target, WorkRequest, drive
    from pdflow.bench.workloads.load import random_token_ids
    from pdflow.serve.api import EngineHost, create_app
    from pdflow.serve.backend import LLMBackend
    from pdflow.serve.server import ServerThread
    from pdflow.spec import ParallelSpec

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    parallel = ParallelSpec(block_size=args.block_size, kv_page_tokens=args.block_size,
                            num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(args.requests, 1),
                            enable_prefix_caching=False)  # repeats must not hit a warm cache
    llm = LLM(args.model, parallel)
    rng = random.Random(args.seed)
    prompts = [random_token_ids(rng, args.prompt_len, llm.engine.config.vocab_size) for _ in range(args.requests)]
    sampling = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], sampling)  # warm-up

    backend = LLMBackend(llm)
    reqs = [WorkRequest(prompt=p, max_tokens=args.output_len, ignore_eos=True) for p in prompts]
    offline_s = served_s = float("inf")
    try:
        for _ in range(args.repeats):
            offline, took = run_on_a_thread(lambda: offline_waves(llm, prompts, sampling, args.concurrency))
            offline_s = min(offline_s, took)
            host = EngineHost(backend).start()
            try:
                with ServerThread(create_app(host, model_name="bench")) as server:
                    results, took = asyncio.run(drive(Target(url=server.url, model="bench"), reqs,
                                                      concurrency=args.concurrency, timeout_s=3600,
                                                      progress=False))
                served_s = min(served_s, took)
            finally:
                host.stop()
    finally:
        llm.shutdown()
    offline_tokens = sum(len(o.token_ids) for o in offline)
    served_tokens = sum(r.completion_tokens for r in results if r.ok)
    same = all(r.ok for r in results) and served_tokens == offline_tokens
    print(f"requests {args.requests}, prompt {args.prompt_len}, output {args.output_len}, "
          f"concurrency {args.concurrency}")
    print(f"offline LLM.generate : {offline_tokens / offline_s:8.1f} output tok/s ({offline_s:.2f} s)")
    print(f"OpenAI API over HTTP : {served_tokens / served_s:8.1f} output tok/s ({served_s:.2f} s)")
    print(f"ratio (API / offline): {(served_tokens / served_s) / (offline_tokens / offline_s):.3f}"
          f"{'' if same else '  (token counts differ: check errors)'}")


if __name__ == "__main__":
    main()
