"""Drafters on the ``triton`` backend (its store, block and decode kernels; CPU:
TRITON_INTERPRET) propose what they propose on the ``torch`` backend."""

from __future__ import annotations

import pytest
import torch
from specdec_helpers import block_table, slots, small_drafter, small_graph, small_target

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.spec_decode import ContextBatch, ProposeBatch

BLOCKS = [3, 1]
N, K = 40, 3


def _draft(drafter, backend_name: str) -> torch.Tensor:
    pool = KVCacheBinding(list(drafter.units.values()), 6, torch.device("cpu"))
    drafter.bind_cache(pool.caches, get_backend(backend_name))
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(N, drafter.config.feature_size, generator=gen)
    ids = torch.randint(0, 48, (N,), generator=gen)
    drafter.release(["t"])
    drafter.write_context_kv(ContextBatch(
        seq_ids=["t"], cu_seqlens=[0, N], start_positions=[0], features=feats, positions=torch.arange(N),
        slot_mapping=slots(BLOCKS, 0, N), token_ids=ids, next_token_ids=[-1],
    ))
    drafter.commit(["t"], [N])
    return drafter.propose(ProposeBatch(
        seq_ids=["t"], anchor_ids=ids[-1:], anchor_positions=[N], block_tables=block_table(BLOCKS),
        num_drafts=K, anchor_features=feats[-1:],
    )).logits


@pytest.mark.parametrize("kind", ["dspark", "eagle"])
def test_triton_backend_drafts_like_torch(kind):
    graph = small_graph(kind)
    cfg, target = small_target(graph)
    drafter, _ = small_drafter(graph, cfg, target, num_blocks=6)
    with torch.no_grad():
        want = _draft(drafter, "torch")
        got = _draft(drafter, "triton")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
