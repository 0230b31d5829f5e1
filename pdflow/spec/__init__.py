"""Typed config schema for every Hydra group (no torch, no processes)."""

from pdflow.spec.drafter import DrafterSpec
from pdflow.spec.model import ModelSpec
from pdflow.spec.parallel import ParallelSpec
from pdflow.spec.router import RouterSpec
from pdflow.spec.run import RunSpec, ServeSpec, SloSpec, TrackingSpec, WorkloadSpec
from pdflow.spec.transfer import TransferSpec

__all__ = [
    "DrafterSpec",
    "ModelSpec",
    "ParallelSpec",
    "RouterSpec",
    "RunSpec",
    "ServeSpec",
    "SloSpec",
    "TrackingSpec",
    "TransferSpec",
    "WorkloadSpec",
]
