"""When the model runs the fused Triton kernels (RMSNorm + residual add, SiLU-and-mul,
RoPE with qk-norm and the KV write, the MoE experts' grouped GEMMs) instead of the torch ops.

A bf16 decode step of a small model is otherwise thousands of 1-4 us elementwise kernels
(issue 15's profile). Auto, the default: fused only for CUDA tensors with the triton
attention backend bound (the GPU serving path). The CPU path keeps the torch ops, so its
greedy outputs stay bit-identical to transformers (the oracle tests). A model's
``fused_kernels`` (True/False; None: auto) overrides, initialised from the environment
variable ``PDFLOW_FUSED_KERNELS`` (on/off/auto) so a benchmark can compare both through
the public API; forced on for CPU tensors, the kernels run under TRITON_INTERPRET.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV = "PDFLOW_FUSED_KERNELS"
_SETTINGS = {"auto": None, "": None, "on": True, "1": True, "off": False, "0": False}


def setting_from_env() -> bool | None:
    """True (on), False (off) or None (auto) from ``PDFLOW_FUSED_KERNELS``."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw not in _SETTINGS:
        raise ValueError(f"{ENV}={raw!r} is not a setting; use on, off or auto (the default)")
    return _SETTINGS[raw]


def enabled(setting: bool | None, x: torch.Tensor, backend) -> bool:
    """Whether this forward pass fuses: the explicit setting, else CUDA + triton."""
    if setting is not None:
        return setting
    return x.is_cuda and getattr(backend, "name", None) == "triton"


def _fused_moe(*args):
    """``kernels.fused_moe.fused_moe``, imported when an MoE layer first runs fused."""
    from pdflow.kernels.fused_moe import fused_moe

    return fused_moe(*args)


@dataclass(kw_only=True, slots=True, frozen=True)
class FusedOps:
    rms_norm: Callable
    silu_and_mul: Callable
    qk_rope_: Callable
    fused_moe: Callable = _fused_moe


@functools.cache
def ops() -> FusedOps:
    """The kernels, imported on first use (triton costs nothing until a fused pass). With
    no CUDA device they can only run interpreted, which triton decides at decoration."""
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "fused kernels without CUDA run under TRITON_INTERPRET=1, which must be set "
                "before triton is imported; set it in the environment, or leave "
                f"{ENV} at auto/off on CPU")
        os.environ["TRITON_INTERPRET"] = "1"
    from pdflow.kernels.qk_rope import qk_rope_
    from pdflow.kernels.rms_norm import rms_norm
    from pdflow.kernels.silu_and_mul import silu_and_mul

    return FusedOps(rms_norm=rms_norm, silu_and_mul=silu_and_mul, qk_rope_=qk_rope_)
