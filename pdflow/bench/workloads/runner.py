"""Build the workloads a spec names and run them against an endpoint, one after another."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

from pdflow.bench.workloads.base import RequestResult, TurnTaking, WorkloadFailed, WorkloadResult, WorkRequest
from pdflow.bench.workloads.client import Target, drive, drive_turns
from pdflow.bench.workloads.goodput import GoodputResult, attainment, make_probe, search
from pdflow.bench.workloads.load import PrefillWorkload, ReplayWorkload, ServeWorkload
from pdflow.bench.workloads.multiturn import MultiTurnWorkload
from pdflow.bench.workloads.stats import latency_metrics
from pdflow.bench.workloads.tasks import ArithWorkload, NeedleWorkload
from pdflow.spec import WorkloadSpec


def build_workloads(spec: WorkloadSpec, *, vocab: int, base_dir: Path | None = None, block_tokens: int = 16,
                    kv_bytes_per_block: int = 0) -> list:
    """``kind: accuracy`` is arith then needle; ``none`` is nothing. Relative trace paths
    resolve against ``base_dir`` (the launch directory). ``block_tokens`` and
    ``kv_bytes_per_block`` (the graph's transfer per block): multiturn's bytes moved."""
    kinds = {
        "none": lambda: [],
        "arith": lambda: [ArithWorkload(spec)],
        "needle": lambda: [NeedleWorkload(spec)],
        "accuracy": lambda: [ArithWorkload(spec), NeedleWorkload(spec)],
        "prefill": lambda: [PrefillWorkload(spec, vocab=vocab)],
        "serve": lambda: [ServeWorkload(spec, vocab=vocab)],
        "replay": lambda: [ReplayWorkload(spec, vocab=vocab, base_dir=base_dir)],
        "multiturn": lambda: [MultiTurnWorkload(spec, vocab=vocab, block_tokens=block_tokens,
                                                kv_bytes_per_block=kv_bytes_per_block)],
    }
    return kinds[spec.kind]()


def _rows(phase: str, requests: list[WorkRequest], results: list[RequestResult]) -> list[dict]:
    rows = []
    for i, (q, r) in enumerate(zip(requests, results, strict=True)):
        rows.append({
            "workload": phase, "index": i, "ok": r.ok, "error": r.error, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "ttft_s": r.ttft_s,
            "latency_s": r.latency_s, "sent_at_s": r.sent_at_s, "output": r.text, "cached_tokens": r.cached_tokens,
        } | {k: v for k, v in q.meta.items()})
    return rows


async def goodput_of(target: Target, requests: list[WorkRequest], spec: WorkloadSpec) -> GoodputResult:
    """The goodput search over these requests (open loop: every request may be in flight).
    One untimed request goes first: a cold server's first request (connections, lazy
    compilation) would otherwise fail the first probe, which the search then reads as the
    knee and bisects below the start rate."""

    async def send(timed: list[WorkRequest]) -> list[RequestResult]:
        results, _ = await drive(target, timed, concurrency=max(1, len(timed)), timeout_s=spec.request_timeout_s,
                                 progress=False, label="goodput")
        return results

    if requests:
        await send([replace(requests[0], arrival_s=None)])
    return await search(make_probe(send, requests, spec.slo, seed=spec.seed), spec.slo)


def prepare(workloads: list) -> list[tuple]:
    """(workload, its requests) pairs: building requests reads traces and makes prompts,
    so a bad trace is refused before anything is launched."""
    return [(w, w.requests()) for w in workloads]


async def run_workloads(target: Target, prepared: list[tuple], spec: WorkloadSpec) -> WorkloadResult:
    """Runs ``prepare``'s pairs in order. Metrics of a single workload are unprefixed;
    with several, latency metrics carry the workload's name (task metrics are named by
    their task already)."""
    metrics: dict[str, float] = {}
    rows: list[dict] = []
    breakdowns: dict[str, dict[str, float]] = {}
    per_workload: dict[str, dict[str, float]] = {}
    for workload, requests in prepared:
        if isinstance(workload, TurnTaking) and workload.closed_loop:  # the answers make the rest
            requests, results, wall = await drive_turns(
                target, requests, workload.follow_up, concurrency=spec.concurrency,
                timeout_s=spec.request_timeout_s, progress=spec.progress, label=workload.name,
                total=spec.num_requests)
        else:
            results, wall = await drive(target, requests, concurrency=spec.concurrency,
                                        timeout_s=spec.request_timeout_s, progress=spec.progress,
                                        label=workload.name)
        if requests and not any(r.ok for r in results):
            raise WorkloadFailed(f"all {len(results)} {workload.name} requests failed; the first: "
                                 f"{results[0].error}")
        task, parts = workload.score(requests, results)
        if spec.slo.enabled and workload.name in ("serve", "replay"):
            found = await goodput_of(target, requests, spec)
            task = task | {"slo_attainment": attainment(results, spec.slo)} | found.metrics()
            parts = parts | found.breakdown()
        prefix = f"{workload.name}_" if len(prepared) > 1 else ""
        latency = latency_metrics(results, wall)
        metrics |= {prefix + k: v for k, v in latency.items()} | task
        own = latency | task
        if workload.accuracy_metric is not None:
            own["accuracy"] = task[workload.accuracy_metric]
        per_workload[workload.name] = {k: float(v) for k, v in own.items() if not math.isnan(v)}
        breakdowns |= parts
        rows += _rows(workload.name, requests, results)
    finite = {k: float(v) for k, v in metrics.items() if not math.isnan(v)}
    return WorkloadResult(name=spec.kind, metrics=finite, rows=rows, breakdowns=breakdowns,
                          per_workload=per_workload)


def run_workloads_sync(target: Target, prepared: list[tuple], spec: WorkloadSpec) -> WorkloadResult:
    return asyncio.run(run_workloads(target, prepared, spec))
