"""DSpark under TP2 (two gloo processes): each rank holds the draft heads the graph
placed on it, writes exactly its slice of the TP1 context cache, and proposes the TP1
logits (all-reduced o_proj/MLP, all-gathered LM head)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from specdec_helpers import BLOCK, small_drafter, small_graph, small_target

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.model.layers import ParallelLMHead, VocabParallelEmbedding, set_tp_group
from pdflow.spec_decode import ContextBatch, ProposeBatch, load_drafter, save_drafter

BLOCKS = [3, 0, 6]
N, K = 45, 5


def _inputs(feature_size: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, feature_size, generator=gen), torch.randint(0, 48, (N,), generator=gen)


def _run(drafter):
    feats, ids = _inputs(drafter.config.feature_size)
    pos = torch.arange(N)
    slot = torch.tensor(BLOCKS)[pos // BLOCK] * BLOCK + pos % BLOCK
    drafter.write_context_kv(ContextBatch(seq_ids=["a"], cu_seqlens=[0, N], start_positions=[0], features=feats,
                                          positions=pos, slot_mapping=slot, token_ids=ids))
    drafter.commit(["a"], [N])
    return drafter.propose(ProposeBatch(
        seq_ids=["a"], anchor_ids=ids[-1:], anchor_positions=[N],
        block_tables=torch.tensor([BLOCKS], dtype=torch.int32), num_drafts=K,
    )).logits


def _rank(rank: int, rendezvous: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    set_tp_group(None)
    try:
        graph = small_graph("dspark", tp=2)
        plan = graph.rank("decode", rank)
        drafter = load_drafter(folder, plan.units, tp_rank=rank, tp_size=2)
        shared = torch.load(f"{folder}/shared.pt")
        embed, head = VocabParallelEmbedding(48, 64, rank, 2), ParallelLMHead(48, 64, rank, 2)
        embed.weight_loader(embed.weight, shared["embed"])
        head.weight_loader(head.weight, shared["head"])
        drafter.bind_target(embed, head)
        pool = KVCacheBinding([u for u in plan.units if u.family == "draft"], 12, torch.device("cpu"))
        drafter.bind_cache(pool.caches, get_backend("torch"))
        with torch.no_grad():
            logits = _run(drafter)
        torch.save({"logits": logits, "caches": dict(pool.caches), "heads": plan.draft_heads}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_ranks_hold_their_heads_and_propose_the_tp1_logits(tmp_path):
    graph = small_graph("dspark")
    cfg, target = small_target(graph)
    drafter, pool = small_drafter(graph, cfg, target, num_blocks=12)
    with torch.no_grad():
        want = _run(drafter)
    save_drafter(drafter, tmp_path)
    torch.save({"embed": target.model.embed_tokens.weight.detach().clone(),
                "head": target.lm_head.weight.detach().clone()}, tmp_path / "shared.pt")
    rendezvous = str(tmp_path / "rendezvous")  # a file: no port to race other tests for
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, rendezvous, str(tmp_path), outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        got = torch.load(outs[r])
        torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)
        assert got["heads"] == (r,)
        for key, cache in pool.caches.items():
            torch.testing.assert_close(got["caches"][key], cache[:, :, r:r + 1], rtol=1e-5, atol=1e-5)
