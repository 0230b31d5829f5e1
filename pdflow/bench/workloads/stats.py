"""Latency and throughput figures from per-request results (numbers only, no I/O)."""

from __future__ import annotations

import math

from pdflow.bench.workloads.base import RequestResult


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def latency_metrics(results: list[RequestResult], wall_s: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    latency = [r.latency_s for r in ok if r.latency_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    wall = max(wall_s, 1e-9)
    out = {
        "requests": float(len(results)),
        "errors": float(len(results) - len(ok)),
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall,
        "prompt_tokens": float(prompt),
        "output_tokens": float(output),
        "prompt_throughput_tok_s": prompt / wall,
        "output_throughput_tok_s": output / wall,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "latency_mean_s": mean(latency),
        "latency_p99_s": percentile(latency, 99),
    }
    return out | draft_metrics(ok)


def draft_metrics(results: list[RequestResult]) -> dict[str, float]:
    """Acceptance and tokens per forward, only when the server reported draft counts."""
    counted = [r for r in results if r.num_draft_tokens is not None and r.num_verify_steps]
    if not counted:
        return {}
    drafted = sum(r.num_draft_tokens for r in counted)
    accepted = sum(r.num_accepted_draft_tokens or 0 for r in counted)
    steps = sum(r.num_verify_steps for r in counted)
    return {
        "draft_acceptance_rate": accepted / drafted if drafted else math.nan,
        "tokens_per_forward": (accepted + steps) / steps,
    }
