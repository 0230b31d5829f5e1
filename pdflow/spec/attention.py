"""Attention backends as the spec and the graph see them: the ``auto`` choice.

Torch-free, so ``pdflow plan`` resolves the backend without importing a kernel. The
backends themselves live in pdflow/attention/ under the same names.
"""

from __future__ import annotations

AUTO = "auto"


def resolve_attention_backend(name: str, device: str) -> str:
    """``auto``: the Triton kernels on a CUDA device, the torch ops on CPU; any other
    name as given."""
    if name != AUTO:
        return name
    return "triton" if device.split(":")[0] == "cuda" else "torch"
