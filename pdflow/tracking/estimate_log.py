"""What every ``pdflow run`` logs beside its measurements: each side's pool, the plan-time
estimate (when this machine has a profile), and what a search maximizes.

A run whose workload has SLOs and whose estimate says no rate can meet them is pruned:
it is logged (FINISHED, tag ``pdflow.pruned`` with the reason, objective 0) and never
launched, so a sweep spends its time on deployments that can win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdflow.bench.estimate import Estimate, EstimateError, devices_of, estimate_run
from pdflow.bench.profile import MachineProfile, default_path
from pdflow.graph import RunGraph

PRUNED_TAG = "pdflow.pruned"
OBJECTIVE = "goodput_per_device"


@dataclass(kw_only=True, slots=True)
class PlannedRun:
    devices: int
    estimate: Estimate | None
    pruned: str | None = None  # why, when the estimate says the SLOs cannot be met
    # What was logged before launch (pools, devices, the estimate's figures).
    metrics: dict[str, float] = field(default_factory=dict)


def plan_run(tracked, graph: RunGraph, profile_path: Path | None = None) -> PlannedRun:
    """Log pools and the estimate; decide whether the run is worth launching."""
    metrics = {f"{role}_pool_blocks": float(b.pool_blocks) for role, b in graph.budgets.items()}
    planned = PlannedRun(devices=devices_of(graph), estimate=None)
    metrics["devices"] = float(planned.devices)
    path = profile_path or default_path()
    if path.is_file():
        try:
            planned.estimate = estimate_run(graph, MachineProfile.load(path))
        except EstimateError as err:
            tracked.set_tag("pdflow.estimate", f"none: {err}")
    if planned.estimate is not None:
        tracked.log_json("estimate.json", planned.estimate.to_dict())
        metrics |= planned.estimate.metrics()
        slo = graph.spec.workload.slo
        if slo.enabled and planned.estimate.goodput_req_s <= 0:
            planned.pruned = "; ".join(planned.estimate.limits)
            tracked.set_tag(PRUNED_TAG, planned.pruned)
    tracked.log_metrics(metrics)
    planned.metrics = metrics
    return planned


def measured_extras(planned: PlannedRun, metrics: dict[str, float]) -> dict[str, float]:
    """Goodput per device, and estimate / measured where both exist."""
    out: dict[str, float] = {}
    if "goodput_req_s" in metrics:
        out[OBJECTIVE] = metrics["goodput_req_s"] / planned.devices
    if "output_throughput_tok_s" in metrics:
        out["output_tok_s_per_device"] = metrics["output_throughput_tok_s"] / planned.devices
    est = planned.estimate
    if est is not None and metrics.get("goodput_req_s"):
        out["goodput_est_over_measured"] = est.goodput_req_s / metrics["goodput_req_s"]
    if est is not None and metrics.get("ttft_p50_s") and est.input_len in est.ttft_s:
        out["ttft_est_over_measured"] = est.ttft_s[est.input_len] / metrics["ttft_p50_s"]
    return out
