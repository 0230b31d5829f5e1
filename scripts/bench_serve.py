#!/usr/bin/env python
"""HTTP serving vs the offline engine: the same LLM, prompts and output lengths (greedy,
EOS ignored), first through ``LLM.generate`` in waves of ``--concurrency`` prompts, then
through the OpenAI API (engine-loop thread, uvicorn, streamed SSE) with ``--concurrency``
clients. Over HTTP requests arrive staggered and batch differently than a wave does, so
the API's own overhead is the ratio at ``--concurrency 1`` (the default). The two alternate ``--repeats`` times (the best time of each counts, so a busy
machine hurts neither side more). Prints output tokens/s for both and their ratio.

    python scripts/bench_serve.py                      # shipped tiny model, CPU
    python scripts/bench_serve.py --requests 32 --concurrency 8 --output-len 32
    python scripts/bench_serve.py --front split --requests 32 --concurrency 8 --output-len 32

``--front thread`` (the default): the API on a thread of this process over an engine-loop
thread (what ``pdflow serve`` ran before issue 30). ``--front split``: ``pdflow serve``'s
server, the engine core in a process of its own and ``--api-servers`` front processes
(offline: the same spec's ``Deployment`` in this process). Prints TTFT/ITL p50/p99 of the
served side, the hardware and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
    p.add_argument("--front", choices=("thread", "split"), default="thread")
    p.add_argument("--no-stream", action="store_true", help="whole JSON answers instead of SSE")
    p.add_argument("--api-servers", type=int, default=1, help="--front split: API front processes")
    p.add_argument("--overrides", nargs="*", default=[], help="--front split: extra hydra overrides")
    p.add_argument("--client-procs", type=int, default=0,
                   help="client processes sharing the load (0: client_procs_for: at least one per 16 "
                        "streams, and up to one per stream on half the host's cores)")
    args = p.parse_args()
    args.client_procs = args.client_procs or client_procs_for(args.concurrency)
    return args


def client_procs_for(concurrency: int, cores: int | None = None) -> int:
    """Client processes for a load: one Python client serving many streams is itself a
    bottleneck (one H200, C=8, 512/128: one client process for the 8 streams measured
    0.92x offline, eight 0.96x; TTFT p50 24 -> 19 ms), so up to one per stream on half
    the host's cores (the other half serve), and at least one per 16 streams."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(concurrency, max(-(-concurrency // 16), min(8, cores // 2))))


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


async def drive_plain(url: str, model: str, reqs, *, concurrency: int):
    """Not streamed: one JSON answer per request (TTFT is then the whole latency)."""
    import httpx

    from pdflow.bench.workloads.base import RequestResult

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=3600) as client:
        t0 = time.perf_counter()

        async def one(req):
            async with gate:
                sent = time.perf_counter()
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                    "ignore_eos": True})
                took = time.perf_counter() - sent
            ok = r.status_code == 200
            return RequestResult(ok=ok, completion_tokens=r.json()["usage"]["completion_tokens"] if ok else 0,
                                 ttft_s=took, latency_s=took, error=None if ok else r.text)

        results = await asyncio.gather(*(one(r) for r in reqs))
        return list(results), time.perf_counter() - t0


def _client_share(url: str, model: str, reqs, concurrency: int, stream: bool, barrier, out) -> None:
    """One client process: its share of the requests at its share of the concurrency,
    started with the others (barrier); puts its results and its wall-clock span."""
    from pdflow.bench.workloads import Target, drive

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    barrier.wait()
    start = time.time()
    if stream:
        results, _ = run(drive(Target(url=url, model=model), reqs, concurrency=concurrency, timeout_s=3600,
                               progress=False))
    else:
        results, _ = run(drive_plain(url, model, reqs, concurrency=concurrency))
    out.put((results, start, time.time()))


def _drive(args, target, reqs, drive):
    """All requests through ``--client-procs`` client processes (one Python client tops
    out near 10-20k SSE events/s: the load generator must not be what is measured)."""
    import multiprocessing as mp

    procs = args.client_procs
    if procs == 1:
        if args.no_stream:
            return asyncio.run(drive_plain(target.url, target.model, reqs, concurrency=args.concurrency))
        return asyncio.run(drive(target, reqs, concurrency=args.concurrency, timeout_s=3600, progress=False))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    shares = [(reqs[i::procs], args.concurrency // procs + (i < args.concurrency % procs)) for i in range(procs)]
    workers = [ctx.Process(target=_client_share, args=(target.url, target.model, share, conc,
                                                       not args.no_stream, barrier, out))
               for share, conc in shares]
    for w in workers:
        w.start()
    parts = [out.get() for _ in workers]
    for w in workers:
        w.join()
    results = [r for part, _, _ in parts for r in part]
    return results, max(end for *_, end in parts) - min(start for _, start, _ in parts)


def _pct(values: list[float], q: float) -> float:
    """Milliseconds at quantile ``q`` (the project's ``percentile``)."""
    from pdflow.bench.workloads.stats import percentile

    return percentile(values, q * 100) * 1e3


def report(args, offline_tokens: int, offline_s: float, results: list, served_s: float) -> None:
    import platform

    from pdflow.tracking.tags import git_tags

    served_tokens = sum(r.completion_tokens for r in results if r.ok)
    same = all(r.ok for r in results) and served_tokens == offline_tokens
    commit = git_tags().get("pdflow.git_commit", "unknown")[:7]  # PDFLOW_GIT_COMMIT names a copied tree's
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    itl = [gap for r in results for gap in r.itl_s]
    import torch

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"front {args.front} (api servers {args.api_servers}), {'not ' if args.no_stream else ''}streamed, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs{gpu}, commit {commit}")
    print(f"requests {args.requests}, prompt {args.prompt_len}, output {args.output_len}, "
          f"concurrency {args.concurrency}, client processes {args.client_procs}")
    print(f"offline              : {offline_tokens / offline_s:8.1f} output tok/s ({offline_s:.2f} s)")
    print(f"OpenAI API over HTTP : {served_tokens / served_s:8.1f} output tok/s ({served_s:.2f} s); "
          f"TTFT p50 {_pct(ttft, .5):.1f} p99 {_pct(ttft, .99):.1f} ms, ITL p50 {_pct(itl, .5):.1f} "
          f"p99 {_pct(itl, .99):.1f} ms")
    print(f"ratio (API / offline): {(served_tokens / served_s) / (offline_tokens / offline_s):.3f}"
          f"{'' if same else '  (token counts differ: check errors)'}")


def main_split(args) -> None:
    from pdflow import Deployment, SamplingParams, compose
    from pdflow.bench.workloads import Target, WorkRequest, drive
    from pdflow.bench.workloads.load import random_token_ids
    from pdflow.serve.launch import serve_spec

    b, n = args.block_size, args.num_kv_blocks
    spec = compose(["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=none", "tracking.enabled=false",
                    f"prefill.block_size={b}", f"decode.block_size={b}",
                    f"prefill.kv_page_tokens={b}", f"decode.kv_page_tokens={b}", f"decode.num_kv_blocks={n}",
                    f"decode.max_num_seqs={max(args.requests, 1)}", "decode.enable_prefix_caching=false",
                    f"serve.api_servers={args.api_servers}", *args.overrides])
    rng = random.Random(args.seed)
    sampling = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    offline_s = served_s = float("inf")
    with Deployment(spec) as deployment:
        prompts = [random_token_ids(rng, args.prompt_len, deployment.vocab_size) for _ in range(args.requests)]
        deployment.generate(prompts[:2], sampling)  # warm-up
        for _ in range(args.repeats):
            offline, took = run_on_a_thread(lambda: offline_waves(deployment, prompts, sampling, args.concurrency))
            offline_s = min(offline_s, took)
    reqs = [WorkRequest(prompt=p, max_tokens=args.output_len, ignore_eos=True) for p in prompts]
    with serve_spec(spec, port=0) as served:
        target = Target(url=served.url, model=served.model_name)
        asyncio.run(drive(target, reqs[:2], concurrency=2, timeout_s=3600, progress=False))  # warm-up
        for _ in range(args.repeats):
            results, took = _drive(args, target, reqs, drive)
            served_s = min(served_s, took)
    report(args, sum(len(o.token_ids) for o in offline), offline_s, results, served_s)


def main() -> None:
    args = parse_args()
    if args.front == "split":
        main_split(args)
        return
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
                    results, took = _drive(args, Target(url=server.url, model="bench"), reqs, drive)
                served_s = min(served_s, took)
            finally:
                host.stop()
    finally:
        llm.shutdown()
    report(args, sum(len(o.token_ids) for o in offline), offline_s, results, served_s)


if __name__ == "__main__":
    main()
