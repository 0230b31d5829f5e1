#!/usr/bin/env python
"""Load through the router: ``--requests`` tiny completions (``--max-tokens`` each, EOS
ignored) at ``--concurrency`` clients, against a P/D deployment (the spec's, by default
the CPU default: tiny model, PP4 prefill -> TP4 decode) behind its API behind a router.
Checks what must hold under load (every request completed, no KV block leaked on either
instance, the Prometheus counters equal the client's count) and prints throughput and
TTFT percentiles, with the offline ``Deployment.generate`` of the same prompts as the
baseline (served / offline throughput).

    python scripts/bench_load.py                                   # 1000 at 64, the default spec
    python scripts/bench_load.py --requests 200 prefill=tp1 decode=tp1 drafter=none

``--prefill N --decode M``: N prefill and M decode instances instead, each its own
``pdflow serve`` process, behind a router process (xPyD). ``--baseline-decode K`` first
runs N prefill with K decode instances on the same prompts, in the same run, and prints
the ratio of req/s. Checks: every request completed, the decode instances counted them,
no block held on any instance afterwards, each (prefill, decode) pair paired once.

    python scripts/bench_load.py --prefill 1 --decode 2 --baseline-decode 1 --requests 48 \
        --concurrency 8 prefill=tp1 decode=tp1 drafter=none
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdflow.bench.workloads.base import RequestResult, WorkRequest
from pdflow.bench.workloads.client import Target, drive


@dataclass(kw_only=True, slots=True)
class LoadReport:
    sent: int
    completed: int
    errors: list[str]
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    completion_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s

    def line(self) -> str:
        return (f"{self.completed}/{self.sent} completed in {self.wall_s:.1f} s: {self.requests_per_s:.1f} req/s, "
                f"{self.completion_tokens / self.wall_s:.1f} tok/s, TTFT p50 {self.ttft_p50_s * 1e3:.0f} ms, "
                f"p99 {self.ttft_p99_s * 1e3:.0f} ms")


def tiny_prompts(n: int, *, vocab: int, length: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_load(url: str, model: str, prompts: list[list[int]], *, max_tokens: int, concurrency: int,
             timeout_s: float = 600.0) -> LoadReport:
    reqs = [WorkRequest(prompt=p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    results, wall = asyncio.run(drive(Target(url=url, model=model), reqs, concurrency=concurrency,
                                      timeout_s=timeout_s, progress=False))
    done: list[RequestResult] = [r for r in results if r.ok and r.completion_tokens == max_tokens]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return LoadReport(sent=len(reqs), completed=len(done), errors=[r.error for r in results if not r.ok][:5],
                      wall_s=wall, ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99),
                      completion_tokens=sum(r.completion_tokens for r in done))


def scrape(url: str) -> dict[tuple, float]:
    """Prometheus samples by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=4, help="prompt tokens per request")
    p.add_argument("--prefill", type=int, default=0, help="prefill instances (separate processes); 0: in process")
    p.add_argument("--decode", type=int, default=1, help="decode instances, with --prefill")
    p.add_argument("--baseline-decode", type=int, default=0,
                   help="with --prefill: first measure this many decode instances on the same load")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run spec (default: the CPU default)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if args.prefill:
        sys.exit(main_topology(args))
    from pdflow import Deployment, SamplingParams, compose
    from pdflow.serve.api import EngineHost, create_app
    from pdflow.serve.backend import LLMBackend
    from pdflow.serve.router import create_router
    from pdflow.serve.server import ServerThread

    deployment = Deployment(compose(args.overrides))
    try:
        prompts = tiny_prompts(args.requests, vocab=deployment.vocab_size, length=args.prompt_len)
        sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        deployment.generate(prompts, sampling)
        offline_s = time.perf_counter() - start
        backend = LLMBackend(deployment)
        host = EngineHost(backend).start()
        try:
            with ServerThread(create_app(host, model_name="load")) as instance, \
                    ServerThread(create_router([instance.url])) as router:
                before = scrape(instance.url)
                report = run_load(router.url, "load", prompts, max_tokens=args.max_tokens,
                                  concurrency=args.concurrency)
                after = scrape(instance.url)
                routed = scrape(router.url)
        finally:
            host.stop()
        counted = sample(after, "pdflow_requests_total", outcome="length") - sample(
            before, "pdflow_requests_total", outcome="length")
        free = deployment.free_kv_blocks()
        total = {role: e.num_kv_blocks for role, e in (("prefill", deployment.producer),
                                                       ("decode", deployment.consumer)) if e is not None}
    finally:
        deployment.shutdown()
    print(f"served : {report.line()}")
    print(f"offline: {args.requests} requests in {offline_s:.1f} s: {args.requests / offline_s:.1f} req/s")
    print(f"served / offline throughput: {report.requests_per_s / (args.requests / offline_s):.2f}")
    print(f"instance counted {counted:.0f} finished, router {sample(routed, 'pdflow_router_requests_total', backend=instance.url, outcome='ok'):.0f} ok; "
          f"free blocks {free} of {total}")
    ok = report.completed == report.sent == counted and free == total
    print("all completed, counters agree, no leak" if ok else f"FAILED: errors {report.errors}")
    sys.exit(0 if ok else 1)


# -- xPyD: separate `pdflow serve` processes behind a router process -----------------------

URL_LINE = re.compile(r" at (http://127\.0\.0\.1:\d+)/v1")


def serve(role: str, overrides: list[str], *extra: str) -> tuple[subprocess.Popen, str]:
    """One ``pdflow serve`` process on a free loopback port, and its URL once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", f"role={role}", "serve.port=0",
                             *overrides, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if found := URL_LINE.search(line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, found.group(1)
    raise RuntimeError(f"pdflow serve role={role} ended before serving:\n" + "".join(seen[-30:]))


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def topology_run(args, prompts: list[list[int]], num_decode: int) -> tuple[LoadReport, bool, str]:
    """``args.prefill`` prefill and ``num_decode`` decode instances under the load: the
    report, whether every check held, and what the checks saw."""
    procs = []
    try:
        started = [serve("prefill", args.overrides) for _ in range(args.prefill)]
        started += [serve("decode", args.overrides) for _ in range(num_decode)]
        procs = [p for p, _ in started]
        prefill = [u for _, u in started[:args.prefill]]
        decode = [u for _, u in started[args.prefill:]]
        router, url = serve("router", args.overrides, f"serve.prefill=[{','.join(prefill)}]",
                            f"serve.decode=[{','.join(decode)}]")
        procs.append(router)
        run_load(url, "tiny", prompts[:max(2, args.concurrency)], max_tokens=args.max_tokens,
                 concurrency=args.concurrency)  # every pair paired, lazy paths warm: not timed
        before = [scrape(u) for u in decode]
        report = run_load(url, "tiny", prompts, max_tokens=args.max_tokens, concurrency=args.concurrency)
        after = {u: scrape(u) for u in prefill + decode}
    finally:
        stop(procs)
    counted = sum(sample(after[u], "pdflow_requests_total", outcome="length") - sample(b, "pdflow_requests_total",
                                                                                       outcome="length")
                  for u, b in zip(decode, before, strict=True))
    held = {u: sample(m, "pdflow_kv_blocks_used") for u, m in after.items()}
    pairings = {u: sorted(v for (name, _), v in m.items() if name == "pdflow_kv_pairings_total")
                for u, m in after.items()}
    ok = (report.completed == report.sent == counted and not any(held.values())
          and all(pairings[u] == [1.0] * num_decode for u in prefill)
          and all(pairings[u] == [1.0] * args.prefill for u in decode))
    return report, ok, f"decode instances counted {counted:.0f}; blocks held {held}; pairings {pairings}"


def main_topology(args) -> int:
    from pdflow import compose

    spec = compose(args.overrides)
    prompts = tiny_prompts(args.requests, vocab=spec.model.vocab, length=args.prompt_len)
    shapes = ([args.baseline_decode] if args.baseline_decode else []) + [args.decode]
    reports, failed = [], False
    for num_decode in shapes:
        report, ok, seen = topology_run(args, prompts, num_decode)
        reports.append(report)
        print(f"{args.prefill}P{num_decode}D: {report.line()}")
        print(f"  {seen}")
        print(f"  {'all completed, counters agree, no leak, each pair paired once' if ok else 'FAILED'}"
              + ("" if ok else f": errors {report.errors}"))
        failed |= not ok
    if len(reports) == 2:
        print(f"{args.prefill}P{args.decode}D / {args.prefill}P{args.baseline_decode}D req/s: "
              f"{reports[1].requests_per_s / reports[0].requests_per_s:.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    main()
