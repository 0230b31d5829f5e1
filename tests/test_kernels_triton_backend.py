"""The ``triton`` attention backend is registered and agrees with ``torch`` through
the engine's PagedAttention layer (CPU: TRITON_INTERPRET)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from kernel_bench import paged_inputs as T  # noqa: E402

from pdflow.attention.backends import get_backend  # noqa: E402
from pdflow.attention.layer import PagedAttention  # noqa: E402
from pdflow.attention.metadata import AttentionMetadata  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _meta(prev, new, bt, bs, decode_only):
    slots, cu, ctx = [], [0], []
    for b, (p, n) in enumerate(zip(prev, new, strict=True)):
        slots += [int(bt[b, i // bs]) * bs + i % bs for i in range(p, p + n)]
        cu.append(cu[-1] + n)
        ctx.append(p + n)
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=DEV)  # noqa: E731
    return AttentionMetadata(decode_only=decode_only, slot_mapping=as_t(slots, torch.int64),
                             cu_seqlens_q=as_t(cu, torch.int32),
                             context_lens=as_t(ctx, torch.int32), block_tables=bt)


def test_triton_backend_matches_torch_through_the_layer():
    tri, ref = get_backend("triton"), get_backend("torch")
    assert tri.name == "triton" and hasattr(tri, "block_attention")
    h_q, h_kv, d, page, ppb = 4, 2, 32, 16, 2
    # New tokens land in the free slots of each sequence's last (NaN-filled) block.
    prev = [20, 1, 7]
    for new, decode_only in (([5, 9, 1], False), ([1, 1, 1], True)):
        outs = []
        for backend in (tri, ref):
            kc, vc, _, bt = T.make_paged(prev, h_kv, d, page, ppb, torch.float32, DEV)
            layer = PagedAttention(layer=0, num_heads=h_q, num_kv_heads=h_kv, head_dim=d,
                                   scale=d**-0.5)
            layer.k_cache, layer.v_cache, layer.backend = kc, vc, backend
            n = sum(new)
            q = T.randn(n, h_q, d, dtype=torch.float32, device=DEV, seed=9)
            k = T.randn(n, h_kv, d, dtype=torch.float32, device=DEV, seed=10)
            v = T.randn(n, h_kv, d, dtype=torch.float32, device=DEV, seed=11)
            outs.append(layer(q, k, v, _meta(prev, new, bt, page * ppb, decode_only)))
        assert torch.isfinite(outs[0]).all()
        assert T.rel_err(outs[0], outs[1]) < 1e-4
