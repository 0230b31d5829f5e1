"""Refusals: every way a deployment is turned down before a byte moves.

Each refusal has a stable code (tests and tooling match on it), a message naming the
parts involved, and a fix a user can apply.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class Code(str, Enum):
    EAGLE3_UNDER_PP = "EAGLE3_UNDER_PP"
    HEAD_CUT_NOT_DIVISIBLE = "HEAD_CUT_NOT_DIVISIBLE"
    UNIT_MISMATCH_HEAD_DIM = "UNIT_MISMATCH_HEAD_DIM"
    UNIT_MISMATCH_DTYPE = "UNIT_MISMATCH_DTYPE"
    UNIT_MISMATCH_PAGE = "UNIT_MISMATCH_PAGE"
    UNIT_MISMATCH_BLOCK = "UNIT_MISMATCH_BLOCK"
    UNIT_MISMATCH_HEADS = "UNIT_MISMATCH_HEADS"
    PAGE_UNDECLARED = "PAGE_UNDECLARED"
    PAGE_NOT_DIVIDING_BLOCK = "PAGE_NOT_DIVIDING_BLOCK"
    REGION_MISSING = "REGION_MISSING"
    REGION_TWO_TO_ONE = "REGION_TWO_TO_ONE"
    REGION_UNFILLED = "REGION_UNFILLED"
    BATCH_OVER_GRID_LIMIT = "BATCH_OVER_GRID_LIMIT"
    BAD_LAYER_PARTITION = "BAD_LAYER_PARTITION"
    DRAFTER_TAP_OUT_OF_RANGE = "DRAFTER_TAP_OUT_OF_RANGE"
    KV_POOL_EMPTY = "KV_POOL_EMPTY"
    MODEL_GEOMETRY_MISMATCH = "MODEL_GEOMETRY_MISMATCH"
    EXPERT_SPLIT_NOT_DIVISIBLE = "EXPERT_SPLIT_NOT_DIVISIBLE"
    OVERLAP_UNSUPPORTED = "OVERLAP_UNSUPPORTED"
    KV_SCALE_PAGE_UNALIGNED = "KV_SCALE_PAGE_UNALIGNED"
    KV_DTYPE_UNSUPPORTED = "KV_DTYPE_UNSUPPORTED"
    # Raised only against the host a command launches on (pdflow.graph.host).
    DEVICE_UNAVAILABLE = "DEVICE_UNAVAILABLE"
    RDMA_UNAVAILABLE = "RDMA_UNAVAILABLE"
    MOONCAKE_HOST_ONLY = "MOONCAKE_HOST_ONLY"
    TRANSFER_UNAVAILABLE = "TRANSFER_UNAVAILABLE"
    # Raised only with the GPUs' memory read at start (pdflow.graph.memory).
    DEVICE_MEMORY_SHORT = "DEVICE_MEMORY_SHORT"
    # Raised only when a live consumer rank pairs with a producer rank (pdflow.transfer).
    PAIRING_RANK_UNKNOWN = "PAIRING_RANK_UNKNOWN"
    PAIRING_REGION_INVALID = "PAIRING_REGION_INVALID"
    PAIRING_PEER_FAILED = "PAIRING_PEER_FAILED"

    def __str__(self) -> str:
        return self.value


# Refusals after which placement cannot be computed at all.
STRUCTURAL = frozenset(
    {
        Code.BAD_LAYER_PARTITION,
        Code.HEAD_CUT_NOT_DIVISIBLE,
        Code.PAGE_UNDECLARED,
        Code.PAGE_NOT_DIVIDING_BLOCK,
    }
)

# Refusals that need a live peer's published memory, never raised by validate().
PAIRING_ONLY = frozenset({Code.PAIRING_RANK_UNKNOWN, Code.PAIRING_REGION_INVALID, Code.PAIRING_PEER_FAILED})

# Refusals that need the launching host's facts, never raised by validate().
HOST_ONLY = frozenset({Code.DEVICE_UNAVAILABLE, Code.RDMA_UNAVAILABLE, Code.MOONCAKE_HOST_ONLY,
                       Code.TRANSFER_UNAVAILABLE, Code.DEVICE_MEMORY_SHORT})


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    code: Code
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message} Fix: {self.fix}"


class GraphRefused(Exception):
    """Raised by commands when the run graph has refusals; carries all of them."""

    def __init__(self, refusals: Iterable[Refusal]):
        self.refusals = list(refusals)
        lines = "\n".join(f"  - {r}" for r in self.refusals)
        count = len(self.refusals)
        super().__init__(f"the run graph is refused ({count} reason{'s' * (count != 1)}):\n{lines}")
