"""The ``torch`` backend: the reference ops of ``pdflow.kernels.reference``, as they are."""

from __future__ import annotations

from pdflow.attention.backends import register_backend
from pdflow.kernels import reference


class TorchBackend:
    name = "torch"
    store_kv = staticmethod(reference.store_kv)
    prefill_attention = staticmethod(reference.prefill_attention)
    decode_attention = staticmethod(reference.decode_attention)


register_backend("torch", TorchBackend)
