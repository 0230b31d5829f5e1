"""Workload, tracking, and the root spec that one composed Hydra config becomes."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from pdflow.spec.drafter import DrafterSpec
from pdflow.spec.model import ModelSpec
from pdflow.spec.parallel import ParallelSpec
from pdflow.spec.transfer import TransferSpec


@dataclass(kw_only=True, slots=True)
class WorkloadSpec:
    """What ``pdflow run`` drives through the deployment (filled in by later issues)."""

    kind: str = "none"
    num_requests: int = 0
    concurrency: int = 1
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("workload needs num_requests >= 0, concurrency >= 1, max_tokens >= 1")


@dataclass(kw_only=True, slots=True)
class TrackingSpec:
    enabled: bool = True
    # Relative sqlite paths are resolved against the launch directory.
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "pdflow"


MODES = ("pd", "monolithic")


@dataclass(kw_only=True, slots=True)
class RunSpec:
    model: ModelSpec = MISSING
    prefill: ParallelSpec = MISSING
    decode: ParallelSpec = MISSING
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    name: str = "pdflow"
    seed: int = 0
    # "pd": a prefill instance writes each prompt's KV into the decode instance.
    # "monolithic": the decode instance serves alone (prefills itself); no producer starts.
    mode: str = "pd"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
