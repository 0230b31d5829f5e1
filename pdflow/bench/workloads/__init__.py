"""Workloads ``pdflow run`` drives through an OpenAI-compatible endpoint over HTTP:
accuracy (arith, needle), prefill cost, mixed serving load, trace replay."""

from pdflow.bench.workloads.base import RequestResult, WorkloadFailed, WorkloadResult, WorkRequest
from pdflow.bench.workloads.client import Target, drive
from pdflow.bench.workloads.runner import build_workloads, prepare, run_workloads, run_workloads_sync

__all__ = [
    "RequestResult",
    "Target",
    "WorkRequest",
    "WorkloadFailed",
    "WorkloadResult",
    "build_workloads",
    "drive",
    "prepare",
    "run_workloads",
    "run_workloads_sync",
]
