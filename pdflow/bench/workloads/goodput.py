"""Goodput: the highest request rate at which the SLOs still hold for enough requests.

A probe sends the workload's requests at one rate (open loop: arrivals do not wait for
answers, as users do not) and measures the attainment, the fraction of requests that
finished with TTFT <= ``slo.ttft_s`` and time per output token <= ``slo.tpot_s``. The
search ramps the rate up by doubling from ``slo.start_rate`` until a probe misses the
target (or ``max_rate`` passes), then bisects between the last rate that held and the
first that did not; goodput is the highest rate that held (0 when none did). DistServe
defines goodput the same way.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from pdflow.bench.workloads.base import RequestResult, WorkRequest
from pdflow.spec import SloSpec


@dataclass(kw_only=True, slots=True)
class Probe:
    rate: float
    attainment: float


@dataclass(kw_only=True, slots=True)
class GoodputResult:
    goodput: float
    probes: list[Probe] = field(default_factory=list)
    # False: no rate tried missed the target (max_rate held, or the probes ran out on
    # the ramp), so goodput is a lower bound.
    bracketed: bool = True

    def metrics(self) -> dict[str, float]:
        """``goodput_req_s`` and the attainment at each rate tried."""
        out = {"goodput_req_s": self.goodput, "goodput_probes": float(len(self.probes)),
               "goodput_bracketed": float(self.bracketed)}
        out |= {f"slo_attainment/rate_{p.rate:.4g}": p.attainment for p in self.probes}
        return out

    def breakdown(self) -> dict[str, dict[str, float]]:
        return {"SLO attainment per request rate": {f"{p.rate:.3g}/s": p.attainment
                                                   for p in sorted(self.probes, key=lambda p: p.rate)}}


def tpot_s(result: RequestResult) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    if result.ttft_s is None or result.latency_s is None or result.completion_tokens < 2:
        return None
    return (result.latency_s - result.ttft_s) / (result.completion_tokens - 1)


def meets(result: RequestResult, slo: SloSpec) -> bool:
    if not result.ok or result.ttft_s is None:
        return False
    if slo.ttft_s is not None and result.ttft_s > slo.ttft_s:
        return False
    tpot = tpot_s(result)
    return slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s


def attainment(results: list[RequestResult], slo: SloSpec) -> float:
    return sum(meets(r, slo) for r in results) / len(results) if results else 0.0


def at_rate(requests: list[WorkRequest], rate: float, *, arrivals: str, seed: int = 0) -> list[WorkRequest]:
    """The requests re-timed to ``rate`` per second. A trace keeps its shape, scaled so
    its mean rate is ``rate``; untimed requests get Poisson (or even) gaps."""
    timed = [r.arrival_s for r in requests if r.arrival_s is not None]
    if len(timed) == len(requests) and len(timed) > 1 and max(timed) > min(timed):
        span = max(timed) - min(timed)
        scale = (len(timed) - 1) / span / rate
        return [replace(r, arrival_s=(r.arrival_s - min(timed)) * scale) for r in requests]
    rng, clock, out = random.Random(f"goodput:{seed}:{rate}"), 0.0, []
    for r in requests:
        out.append(replace(r, arrival_s=clock))
        clock += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
    return out


def sustained(requests: list[WorkRequest], rate: float, probe_s: float | None) -> list[WorkRequest]:
    """At least ``rate * probe_s`` requests, the workload's repeated in order (``at_rate``
    spaces them); the requests as they are without ``probe_s`` or for a timed trace (its
    own shape and length)."""
    if probe_s is None or not requests or any(r.arrival_s is not None for r in requests):
        return requests
    n = max(len(requests), math.ceil(rate * probe_s))
    return [replace(requests[i % len(requests)], arrival_s=None) for i in range(n)]


async def search(measure: Callable[[float], Awaitable[float]], slo: SloSpec) -> GoodputResult:
    """Ramp, then bisect; ``measure(rate)`` returns the attainment at that rate."""
    probes: list[Probe] = []

    async def held(rate: float) -> bool:
        probes.append(Probe(rate=rate, attainment=await measure(rate)))
        return probes[-1].attainment >= slo.attainment

    lo, hi, rate = 0.0, None, slo.start_rate
    while len(probes) < slo.max_probes:
        if not await held(rate):
            hi = rate
            break
        lo = rate
        if rate >= slo.max_rate:
            return GoodputResult(goodput=lo, probes=probes, bracketed=False)
        rate = min(rate * 2, slo.max_rate)
    while hi is not None and len(probes) < slo.max_probes and hi - lo > slo.rel_tol * hi:
        mid = (lo + hi) / 2 if lo == 0 else (lo * hi) ** 0.5
        if await held(mid):
            lo = mid
        else:
            hi = mid
    return GoodputResult(goodput=lo, probes=probes, bracketed=hi is not None)


def make_probe(send: Callable[[list[WorkRequest]], Awaitable[list[RequestResult]]],
               requests: list[WorkRequest], slo: SloSpec, *, seed: int = 0):
    """``measure(rate)`` for ``search``: send the requests at the rate, score them."""

    async def measure(rate: float) -> float:
        return attainment(await send(at_rate(sustained(requests, rate, slo.probe_s), rate, arrivals=slo.arrivals,
                                             seed=seed)), slo)

    return measure
