"""DSpark: placement from the graph, the paged block pass against a naive dense
reference, the training path against the serving path, context K/V per chunk."""

from __future__ import annotations

import math

import pytest
import torch
from specdec_helpers import (
    BLOCK,
    TargetRunner,
    slots,
    small_drafter,
    small_graph,
    small_target,
)

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.spec_decode import (
    ContextBatch,
    ContextFeatureMismatch,
    ContextGap,
    DrafterConfigMismatch,
    DraftPlacementMismatch,
    ProposeBatch,
    SamplingBatch,
    build_drafter,
    drafter_config_for,
)

BLOCKS = [[7, 2, 11], [4, 9, 1], [0, 5, 13]]  # non-contiguous, per request


@pytest.fixture(scope="module")
def setup():
    graph = small_graph("dspark")
    cfg, target = small_target(graph)
    drafter, binding = small_drafter(graph, cfg, target)
    return graph, cfg, target, drafter


def _features(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _write(drafter, sid: str, blocks, feats, ids, start: int, stop: int) -> None:
    drafter.write_context_kv(ContextBatch(
        seq_ids=[sid], cu_seqlens=[0, stop - start], start_positions=[start], features=feats[start:stop],
        positions=torch.arange(start, stop), slot_mapping=slots(blocks, start, stop), token_ids=ids[start:stop],
    ))
    drafter.commit([sid], [stop])


def test_taps_and_draft_heads_come_from_the_graph(setup):
    graph, cfg, _, drafter = setup
    assert drafter.tap_layers == graph.drafter.taps == (1, 2, 3)
    units = [u for u in graph.rank("decode", 0).units if u.family == "draft"]
    assert {u.page_tokens for u in units} == {16} and drafter.block_size == BLOCK
    tp2 = small_graph("dspark", tp=2)
    dcfg = drafter_config_for(tp2, cfg)
    wrong_rank = tp2.rank("decode", 1).units  # heads (1,), built as tp rank 0
    with pytest.raises(DraftPlacementMismatch, match="heads"):
        build_drafter(dcfg, wrong_rank, tp_rank=0, tp_size=2)
    built = build_drafter(dcfg, tp2.rank("decode", 1).units, tp_rank=1, tp_size=2)
    assert built.layers[0].self_attn.num_kv_heads == 1


def test_a_checkpoint_with_other_taps_is_refused(setup):
    graph, cfg, _, drafter = setup
    drafter.config.check_run(spec=graph.spec.drafter, target=cfg, graph_taps=graph.drafter.taps)
    other = small_graph("dspark", extra=("drafter.taps=[1,3,4]",))
    with pytest.raises(DrafterConfigMismatch, match=r"drafter.taps=\[1, 2, 3\]"):
        drafter.config.check_run(spec=other.spec.drafter, target=cfg, graph_taps=other.drafter.taps)


def test_wrong_feature_width_is_refused(setup):
    _, cfg, _, drafter = setup
    with pytest.raises(ContextFeatureMismatch, match=r"taps \[1, 2, 3\]"):
        drafter.write_context_kv(ContextBatch(
            seq_ids=["w"], cu_seqlens=[0, 2], start_positions=[0], features=torch.zeros(2, cfg.hidden_size),
            positions=torch.arange(2), slot_mapping=torch.arange(2), token_ids=torch.zeros(2, dtype=torch.long),
        ))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE, written out: x [N, H, D] at pos [N]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).float()


def _naive_block(drafter, target, feats: torch.Tensor, anchor: int, p: int, k: int) -> torch.Tensor:
    """Logits [k, V] of one block: context K/V straight from the features (no pool),
    full softmax over context + block, one head at a time."""
    cfg = drafter.config
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    c = drafter.context_norm(feats[:p] @ drafter.fc.weight.T)
    x = torch.cat([target.model.embed_tokens.weight[anchor][None],
                   drafter.mask_embedding[None].expand(k - 1, -1)])
    pc, pb = torch.arange(p), torch.arange(p, p + k)
    for layer in drafter.layers:
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([hq * d, hkv * d, hkv * d])
        h = layer.input_layernorm(x)
        keys = torch.cat([_rope((c @ wk.T).view(p, hkv, d), pc, cfg.rope_theta),
                          _rope((h @ wk.T).view(k, hkv, d), pb, cfg.rope_theta)])
        vals = torch.cat([(c @ wv.T).view(p, hkv, d), (h @ wv.T).view(k, hkv, d)])
        q = _rope((h @ wq.T).view(k, hq, d), pb, cfg.rope_theta)
        heads = []
        for head in range(hq):
            kv = head // (hq // hkv)
            w = torch.softmax(q[:, head] @ keys[:, kv].T / math.sqrt(d), dim=-1)
            heads.append(w @ vals[:, kv])
        x = x + torch.cat(heads, -1) @ layer.self_attn.o_proj.weight.T
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return target.lm_head(drafter.norm(x))


def _propose(drafter, sids, anchors, positions, k, sampling=None, blocks=BLOCKS):
    tables = torch.tensor(blocks[:len(sids)], dtype=torch.int32)
    return drafter.propose(ProposeBatch(
        seq_ids=sids, anchor_ids=torch.tensor(anchors), anchor_positions=positions, block_tables=tables,
        num_drafts=k, sampling=sampling, generator=torch.Generator().manual_seed(0),
    ))


def test_block_pass_equals_naive_dense_attention(setup):
    _, cfg, target, drafter = setup
    lens, k = [37, 5, 64], 5
    feats = [_features(n, drafter.config.feature_size, seed=10 + i) for i, n in enumerate(lens)]
    ids = [torch.randint(0, cfg.vocab_size, (n,)) for n in lens]
    for i, n in enumerate(lens):  # written in two chunks, as a chunked prefill would
        _write(drafter, f"n{i}", BLOCKS[i], feats[i], ids[i], 0, n // 2)
        _write(drafter, f"n{i}", BLOCKS[i], feats[i], ids[i], n // 2, n)
    anchors = [3, 17, 40]
    out = _propose(drafter, [f"n{i}" for i in range(3)], anchors, lens, k)
    assert out.tokens.shape == (3, k) and out.logits.shape == (3, k, cfg.vocab_size) and out.probs is None
    for i, n in enumerate(lens):
        want = _naive_block(drafter, target, feats[i], anchors[i], n, k)
        torch.testing.assert_close(out.logits[i], want, rtol=2e-4, atol=2e-4)
    assert torch.equal(out.tokens, out.logits.argmax(-1))
    # A pass that ignores the block (causal, or context only) would differ: the check can fail.
    shorter = _naive_block(drafter, target, feats[0], anchors[0], lens[0] - 1, k)
    assert not torch.allclose(out.logits[0], shorter, atol=1e-3)


def test_sampled_drafts_come_with_their_distribution(setup):
    _, cfg, _, drafter = setup
    feats = _features(20, drafter.config.feature_size, seed=3)
    _write(drafter, "s", BLOCKS[0], feats, torch.zeros(20, dtype=torch.long), 0, 20)
    out = _propose(drafter, ["s"], [1], [20], 4, SamplingBatch.from_lists([0.8], [5], [0.9]))
    assert out.probs.shape == (1, 4, cfg.vocab_size)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(1, 4))
    assert (out.probs.gather(2, out.tokens[..., None]) > 0).all()
    assert ((out.probs > 0).sum(-1) <= 5).all()


def test_training_path_equals_serving_path(setup):
    _, cfg, _, drafter = setup
    t, k = 50, 6
    feats = _features(t, drafter.config.feature_size, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(5))
    _write(drafter, "d", BLOCKS[1], feats, ids, 0, t)
    anchors = [1, 9, 30, 44]
    dense = drafter.dense_logits(feats[None], ids[None], torch.tensor([anchors]), k)
    for a, p in enumerate(anchors):
        drafter.ledger.valid["d"] = p  # propose from a shorter context: entries [0, p)
        served = _propose(drafter, ["d"], [int(ids[p])], [p], k, blocks=BLOCKS[1:]).logits[0]
        torch.testing.assert_close(dense[0, a], served, rtol=2e-4, atol=2e-4)


def test_chunked_prefill_writes_the_same_cache_as_one_pass():
    graph = small_graph("dspark")
    cfg, target = small_target(graph, seed=7)
    drafter, whole = small_drafter(graph, cfg, target, seed=8)
    runner = TargetRunner(target, cfg, taps=graph.drafter.taps, blocks=BLOCKS[2])
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, taps, _ = runner.forward(ids, 0)
        drafter.write_context_kv(runner.context("one", ids, 0, taps))
        drafter.commit(["one"], [70])
        chunked = KVCacheBinding(list(drafter.units.values()), 24, torch.device("cpu"))
        drafter.bind_cache(chunked.caches, get_backend("torch"))
        for start, stop in ((0, 20), (20, 45), (45, 70)):
            _, taps, _ = runner.forward(ids[start:stop], start)
            drafter.write_context_kv(runner.context("chunks", ids[start:stop], start, taps))
            drafter.commit(["chunks"], [stop])
    used = slots(BLOCKS[2], 0, 70)
    for key, cache in whole.caches.items():
        flat_whole = cache.view(cache.shape[0], -1, *cache.shape[3:])
        assert flat_whole.abs().sum() > 0
        torch.testing.assert_close(_gather(chunked.caches[key], used), _gather(cache, used), rtol=1e-5, atol=1e-5)


def _gather(cache: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """[n, H, D] of the given slots (block, page, head, token-in-page layout)."""
    _, ppb, _, page, _ = cache.shape
    block, off = slot_ids // (ppb * page), slot_ids % (ppb * page)
    return cache[block, off // page, :, off % page]


def test_a_skipped_chunk_or_missing_commit_is_caught(setup):
    _, cfg, _, drafter = setup
    feats = _features(60, drafter.config.feature_size, seed=6)
    ids = torch.zeros(60, dtype=torch.long)
    _write(drafter, "gap", BLOCKS[0], feats, ids, 0, 20)
    with pytest.raises(ContextGap, match=r"\[20, 40\) were never written"):
        _write(drafter, "gap", BLOCKS[0], feats, ids, 40, 60)
    drafter.write_context_kv(ContextBatch(
        seq_ids=["gap"], cu_seqlens=[0, 20], start_positions=[20], features=feats[20:40],
        positions=torch.arange(20, 40), slot_mapping=slots(BLOCKS[0], 20, 40), token_ids=ids[20:40],
    ))
    with pytest.raises(ContextGap, match="never committed"):
        _write(drafter, "gap", BLOCKS[0], feats, ids, 40, 60)
    with pytest.raises(ContextGap, match="propose"):
        _propose(drafter, ["gap"], [0], [40], 3)
    drafter.commit(["gap"], [40])
    assert _propose(drafter, ["gap"], [0], [40], 3).tokens.shape == (1, 3)
    drafter.release(["gap"])
    with pytest.raises(ContextGap):
        _propose(drafter, ["gap"], [0], [40], 3)


def test_verify_step_commits_only_accepted_rows(setup):
    _, cfg, _, drafter = setup
    feats = _features(30, drafter.config.feature_size, seed=12)
    ids = torch.zeros(30, dtype=torch.long)
    _write(drafter, "v", BLOCKS[1], feats, ids, 0, 20)
    # verify forward over anchor + 7 drafts at 20..27; 2 accepted -> tokens [0, 23) final
    drafter.write_context_kv(ContextBatch(
        seq_ids=["v"], cu_seqlens=[0, 8], start_positions=[20], features=feats[20:28],
        positions=torch.arange(20, 28), slot_mapping=slots(BLOCKS[1], 20, 28), token_ids=ids[20:28],
    ))
    drafter.commit(["v"], [23])
    assert drafter.context_entries("v") == 23
    # the next verify starts at the bonus token's position, rewriting rejected rows
    _write(drafter, "v", BLOCKS[1], feats, ids, 23, 30)
    assert drafter.context_entries("v") == 30
