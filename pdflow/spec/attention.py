"""Attention backends as the spec and the graph see them: the ``auto`` choice and the
launch limits a backend declares.

Torch-free, so ``pdflow plan`` resolves the backend and refuses a batch its kernels
cannot launch without importing a kernel. The backends themselves live in
pdflow/attention/ under the same names; one registered there with ``limits`` declares
them here.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


def resolve_attention_backend(name: str, device: str) -> str:
    """``auto``: the Triton kernels on a CUDA device, the torch ops on CPU; any other
    name as given."""
    if name != AUTO:
        return name
    return "triton" if device.split(":")[0] == "cuda" else "torch"


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendLimits:
    """What a backend's kernels cannot launch. ``grid_row_limit``: the most attention
    rows (batched tokens x KV heads per rank) its kernels can put on one grid axis, for a
    backend that puts them on axis y or z (CUDA caps those at 65535); None: no cap, as
    for pdflow's own kernels (rows on axis 0) and the torch ops."""

    grid_row_limit: int | None = None


NO_LIMITS = BackendLimits()
BACKEND_LIMITS: dict[str, BackendLimits] = {"torch": NO_LIMITS, "triton": NO_LIMITS}


def declare_backend_limits(name: str, limits: BackendLimits) -> None:
    BACKEND_LIMITS[name] = limits


def backend_limits(name: str) -> BackendLimits:
    """The limits ``name`` declared (a name that declared none has none known)."""
    return BACKEND_LIMITS.get(name, NO_LIMITS)
