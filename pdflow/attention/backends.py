"""Attention backends by name (``ParallelSpec.attention_backend``).

A backend is any object with ``store_kv``, ``prefill_attention`` and
``decode_attention`` taking the arguments of ``pdflow.kernels.reference``; prefill also
takes ``max_seqlen_q`` (the longest chunk, from the host; None: derive it). Built-in
names map to modules imported on first use (so ``"triton"`` costs nothing until asked
for); ``register_backend`` adds others, with the launch limits its kernels have (the
graph reads them from pdflow.spec.attention, torch-free, to refuse at plan time).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from pdflow.spec.attention import BackendLimits, declare_backend_limits


class AttentionBackend(Protocol):
    name: str

    # ``k_scale``/``v_scale``: an fp8 cache's scale caches (kernels/kv_quant.py); the
    # store quantizes into it, the attention ops dequantize; None for 16/32-bit caches.
    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None: ...

    def prefill_attention(
        self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, *,
        max_seqlen_q: int | None = None, k_scale=None, v_scale=None, out=None,
    ) -> Any: ...  # ``out``: the [T, H_q, D] tensor to write and return (None: a new one)

    def decode_attention(self, q, k_cache, v_cache, context_lens, block_tables, scale,
                         k_scale=None, v_scale=None) -> Any: ...


# name -> module that calls register_backend(name, ...) when imported.
BUILTIN_MODULES = {
    "torch": "pdflow.attention.torch_backend",
    "triton": "pdflow.attention.triton_backend",
}
_factories: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend],
                     limits: BackendLimits | None = None) -> None:
    """Make ``name`` available; ``limits``: what its kernels cannot launch (None: keep
    what pdflow.spec.attention declares for it, no limit for a new name)."""
    _factories[name] = factory
    if limits is not None:
        declare_backend_limits(name, limits)


def get_backend(name: str) -> AttentionBackend:
    if name not in _factories and name in BUILTIN_MODULES:
        try:
            importlib.import_module(BUILTIN_MODULES[name])
        except ModuleNotFoundError as err:
            raise ValueError(f"attention backend {name!r} is not available: {err}") from err
    if name not in _factories:
        known = sorted(set(_factories) | set(BUILTIN_MODULES))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}")
    return _factories[name]()
