"""The ``triton`` backend: pdflow.kernels' Triton ops, same signatures as the reference.

Imported only when the backend is asked for (see backends.BUILTIN_MODULES). Without a
CUDA device the kernels run under TRITON_INTERPRET (slow; for CPU tests of the wiring),
which triton reads when a kernel is decorated: so it is set before the kernel modules
are imported. Decode needs no device->host read (split chunks are cut in-kernel), so
a decode step on this backend can be captured in a CUDA graph; prefill takes the
longest chunk length from the step's metadata (built on the host), so it reads nothing
back either. ``kernels/prefill_auto.py`` picks the prefill kernel (Gluon, TMA or pointer).
"""

from __future__ import annotations

from pdflow.attention.backends import register_backend
from pdflow.kernels.interpreter import use_interpreter_if_no_cuda

use_interpreter_if_no_cuda()

from pdflow.kernels.block_attention import block_attention  # noqa: E402
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402
from pdflow.kernels.prefill_auto import prefill_attention  # noqa: E402
from pdflow.kernels.store_kv import store_kv  # noqa: E402


class TritonBackend:
    name = "triton"
    store_kv = staticmethod(store_kv)
    prefill_attention = staticmethod(prefill_attention)
    decode_attention = staticmethod(decode_attention)
    # DSpark: block_attention(q [B,K,H_q,D], k/v_block [B,K,H_kv,D], k/v_cache,
    # context_lens (excluding the block), block_tables, scale) -> [B,K,H_q,D].
    block_attention = staticmethod(block_attention)


register_backend("triton", TritonBackend)
