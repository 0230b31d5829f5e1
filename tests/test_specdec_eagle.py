"""EAGLE / EAGLE3 chain drafters: paged chains equal the training path, context entries
per chunk, the pending last entry, and the PP refusal at runtime."""

from __future__ import annotations

import pytest
import torch
from specdec_helpers import TargetRunner, block_table, slots, small_drafter, small_graph, small_target

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.graph import PRODUCER, Code
from pdflow.spec_decode import (
    ContextBatch,
    ContextGap,
    Eagle3UnderPP,
    ProposeBatch,
    build_drafter,
    drafter_config_for,
    duties,
)
from pdflow.spec_decode.eagle import eagle3_default_taps

BLOCKS = [3, 8, 1]


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def chain(request):
    graph = small_graph(request.param)
    cfg, target = small_target(graph, seed=2)
    drafter, binding = small_drafter(graph, cfg, target, seed=3)
    taps = drafter.tap_layers
    runner = TargetRunner(target, cfg, taps=taps, blocks=BLOCKS)
    return graph, cfg, target, drafter, runner


def _features(runner, drafter, ids, start):
    hidden, taps, logits = runner.forward(ids, start)
    return (taps if drafter.tap_layers else hidden), logits


def test_eagle3_taps_come_from_its_checkpoint_and_eagle_reads_the_last_hidden(chain):
    graph, cfg, _, drafter, _ = chain
    if drafter.kind == "eagle3":
        assert graph.drafter.taps == ()  # the run config declares none
        assert drafter.tap_layers == eagle3_default_taps(cfg.num_layers) == (2, 3)
        assert drafter.config.feature_size == 2 * cfg.hidden_size
    else:
        assert drafter.tap_layers == () and drafter.config.feature_size == cfg.hidden_size


def test_paged_chain_equals_the_training_path(chain):
    _, cfg, _, drafter, runner = chain
    n, k = 41, 4
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        feats, logits = _features(runner, drafter, ids, 0)
        drafter.write_context_kv(runner.context("c", ids, 0, feats))  # last row waits for its token
        drafter.commit(["c"], [n])
        assert drafter.context_entries("c") == n - 1
        anchor = int(logits[-1].argmax())
        prop = drafter.propose(ProposeBatch(
            seq_ids=["c"], anchor_ids=torch.tensor([anchor]), anchor_positions=[n],
            block_tables=block_table(BLOCKS), num_drafts=k, anchor_features=feats[-1:],
        ))
        assert drafter.context_entries("c") == n  # the first step wrote entry n-1
        # Teacher-force the chain on the drafts it chose: the same computation, densely.
        chain_ids = torch.cat([ids, torch.tensor([anchor]), prop.tokens[0]])
        full_feats = torch.cat([feats, feats.new_zeros(k + 1, feats.shape[1])])
        dense = drafter.dense_logits(full_feats[None], chain_ids[None], steps=k)
    for j in range(k):
        torch.testing.assert_close(prop.logits[0, j], dense[0, j, n - 1], rtol=2e-4, atol=2e-4)
    assert torch.equal(prop.tokens, prop.logits.argmax(-1))


def test_chunks_with_known_next_tokens_write_the_same_entries(chain):
    graph, cfg, target, drafter, runner = chain
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(5))
    whole = drafter.caches
    with torch.no_grad():
        feats, _ = _features(runner, drafter, ids, 0)
        drafter.write_context_kv(runner.context("one", ids, 0, feats))
        drafter.commit(["one"], [60])
        chunked = KVCacheBinding(list(drafter.units.values()), 24, torch.device("cpu"))
        drafter.bind_cache(chunked.caches, get_backend("torch"))
        for start, stop in ((0, 25), (25, 60)):
            f, _ = _features(runner, drafter, ids[start:stop], start)
            nxt = int(ids[stop]) if stop < 60 else -1
            drafter.write_context_kv(runner.context("chunks", ids[start:stop], start, f, next_token=nxt))
            drafter.commit(["chunks"], [stop])
        drafter.bind_cache(whole, get_backend("torch"))
    used = slots(BLOCKS, 0, 59)  # entry 59 waits for the sampled token in both
    for key, cache in whole.items():
        torch.testing.assert_close(_gather(chunked.caches[key], used), _gather(cache, used), rtol=1e-5, atol=1e-5)
    assert drafter.context_entries("chunks") == 59


def test_a_chunk_without_its_next_token_leaves_a_gap(chain):
    _, cfg, _, drafter, runner = chain
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        f, _ = _features(runner, drafter, ids[:20], 0)
        drafter.write_context_kv(runner.context("g", ids[:20], 0, f))  # next token not passed
        drafter.commit(["g"], [20])
        f, _ = _features(runner, drafter, ids[20:], 20)
        with pytest.raises(ContextGap, match=r"\[19, 20\)"):
            drafter.write_context_kv(runner.context("g", ids[20:], 20, f))


def _gather(cache, slot_ids):
    _, ppb, _, page, _ = cache.shape
    block, off = slot_ids // (ppb * page), slot_ids % (ppb * page)
    return cache[block, off // page, :, off % page]


def test_eagle3_refuses_pp_at_runtime():
    graph = small_graph("eagle3")
    assert not graph.refusals
    cfg, _ = small_target(graph)
    dcfg = drafter_config_for(graph, cfg)
    units = graph.rank("decode", 0).units
    with pytest.raises(Eagle3UnderPP, match="pp=2") as err:
        build_drafter(dcfg, units, pp=2)
    assert err.value.code == Code.EAGLE3_UNDER_PP
    assert Code.EAGLE3_UNDER_PP in small_graph("eagle3", prefill="pp2").codes()
    eagle = small_graph("eagle")
    build_drafter(drafter_config_for(eagle, cfg), eagle.rank("decode", 0).units, pp=2)  # eagle may


@pytest.mark.parametrize("kind,proposes", [("dspark", False), ("eagle", True), ("eagle3", True)])
def test_producer_duties_follow_the_graph(kind, proposes):
    graph = small_graph(kind)
    producer = duties(graph.drafter, PRODUCER)
    assert producer.propose is proposes and producer.warmup_propose is proposes
    assert producer.write_context_kv and producer.commit and not producer.keep_drafts
    consumer = duties(graph.drafter, "decode")
    assert consumer.propose and consumer.keep_drafts


def test_one_batched_write_equals_writes_per_request(chain):
    """Rows of several requests in one forward: each request's last row pairs with its
    own next token, never with the next request's first token."""
    _, cfg, _, drafter, _ = chain
    gen = torch.Generator().manual_seed(8)
    lens, starts, tables = [9, 14], [0, 30], [[4, 7], [10, 12]]
    feats = [torch.randn(n, drafter.config.feature_size, generator=gen) for n in lens]
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    nexts = [5, -1]

    def batch(members):
        return ContextBatch(
            seq_ids=[f"b{i}" for i in members], cu_seqlens=[0, *torch.tensor([lens[i] for i in members]).cumsum(0).tolist()],
            start_positions=[starts[i] for i in members], features=torch.cat([feats[i] for i in members]),
            positions=torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in members]),
            slot_mapping=torch.cat([slots(tables[i], starts[i], starts[i] + lens[i]) for i in members]),
            token_ids=torch.cat([ids[i] for i in members]), next_token_ids=[nexts[i] for i in members],
        )

    one = drafter.caches
    with torch.no_grad():
        for i in (0, 1):
            drafter.adopt(f"b{i}", starts[i])
        drafter.write_context_kv(batch([0, 1]))
        apart = KVCacheBinding(list(drafter.units.values()), 24, torch.device("cpu"))
        drafter.bind_cache(apart.caches, get_backend("torch"))
        drafter.release(["b0", "b1"])
        for i in (0, 1):
            drafter.adopt(f"b{i}", starts[i])
            drafter.write_context_kv(batch([i]))
        drafter.bind_cache(one, get_backend("torch"))
    used = torch.cat([slots(tables[0], 0, 9), slots(tables[1], 30, 43)])
    for key, cache in one.items():
        torch.testing.assert_close(_gather(apart.caches[key], used), _gather(cache, used))
    assert drafter.ledger.written["b0"] == 9 and drafter.ledger.written["b1"] == 43
