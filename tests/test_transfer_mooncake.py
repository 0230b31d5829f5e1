"""KV head cuts moved by the real Mooncake Transfer Engine over TCP on loopback.

One engine per rank (producer and consumer ranks of a P/D graph, all in this process).
Every producer cache slot holds a code of (unit, global head, block, token, dim); the
graph's cut plans become descriptors for a block mapping and Mooncake writes them into
poisoned consumer caches. Each consumer rank must then hold exactly its own heads of
the mapped blocks, and nothing else may change. Sending a rank the plan of its
neighbour is caught by the same check, and a failed write raises.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transfer_kit
from transfer_kit import needs_mooncake

from pdflow.attention.kv_cache import TORCH_DTYPES
from pdflow.graph.units import UnitSpec
from pdflow.transfer.descriptors import block_descriptors
from pdflow.transfer.mooncake_engine import TransferError

pytestmark = needs_mooncake
transports = transfer_kit.transports  # the pooled-engine fixture
one_torch_thread = transfer_kit.one_torch_thread

NUM_BLOCKS = 6
SRC_BLOCKS, DST_BLOCKS = [4, 0, 3], [1, 5, 2]
POISON = -7
DEPLOYMENTS = {
    "pp4->tp4": ["prefill=pp4", "decode=tp4"],
    "pp2xtp2->tp4": ["prefill=pp2", "prefill.tp=2", "decode=tp4"],
    "tp4->tp2": ["prefill=tp4", "decode=tp2"],
}
SMALL = ["drafter=dspark", "prefill.block_size=32", "decode.block_size=32",
         "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"]


def codes(unit_id: int, unit: UnitSpec, blocks: int) -> np.ndarray:
    """Integer codes of (unit, global head, block, token, dim) in the unit's cache layout."""
    pages, per_page = unit.pages_per_block, unit.page_tokens
    heads = np.array(unit.heads or (0,), dtype=np.int64)
    blk = np.arange(blocks)[:, None, None, None, None]
    tok = (np.arange(pages)[None, :, None, None, None] * per_page
           + np.arange(per_page)[None, None, None, :, None])
    dim = np.arange(unit.head_dim)[None, None, None, None, :]
    code = ((((unit_id * 8 + heads[None, None, :, None, None]) * 8 + blk) * unit.block_size + tok)
            * unit.head_dim + dim)
    return code % 30011


def int_view(cache: torch.Tensor) -> np.ndarray:
    """The cache's bytes as integers of its element size (codes survive any float dtype)."""
    return cache.view({2: torch.int16, 4: torch.int32}[cache.element_size()]).numpy()


def run_cut(graph, transports, plan_for=lambda cut: cut):
    """Fill producer caches, move every cut plan with Mooncake; returns what a check needs."""
    ids, src, dst, engines = {}, {}, {}, {}
    for side, ranks in (("p", graph.producer.ranks), ("c", graph.consumer.ranks)):
        for rank in ranks:
            engines[(side, rank.rank)] = transports()
            for unit in rank.units:
                ids.setdefault(unit.name, len(ids))
                cache = torch.empty(unit.cache_shape(NUM_BLOCKS), dtype=TORCH_DTYPES[unit.dtype])
                int_view(cache)[...] = codes(ids[unit.name], unit, NUM_BLOCKS) if side == "p" else POISON
                region = engines[(side, rank.rank)].register_unit(unit, cache)
                (src if side == "p" else dst)[(rank.rank, unit.name)] = (cache, region)
    for cut in graph.cuts:
        plan = plan_for(cut)
        src_regions = {n: r for (k, n), (_, r) in src.items() if k == plan.producer_rank}
        dst_regions = {n: r for (k, n), (_, r) in dst.items() if k == plan.consumer_rank}
        desc = block_descriptors(plan, src_regions, dst_regions, SRC_BLOCKS, DST_BLOCKS)
        peer = engines[("c", plan.consumer_rank)].session_id
        engines[("p", plan.producer_rank)].write(peer, desc)
    return ids, dst


def wrong_units(graph, ids, dst) -> list[str]:
    bad = []
    for rank in graph.consumer.ranks:
        for unit in rank.units:
            got = int_view(dst[(rank.rank, unit.name)][0])
            want = np.full_like(got, POISON)
            want[DST_BLOCKS] = codes(ids[unit.name], unit, NUM_BLOCKS)[SRC_BLOCKS]
            if not np.array_equal(got, want):
                bad.append(f"{rank.label}:{unit.name}")
    return bad


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_each_consumer_rank_gets_exactly_its_heads_of_the_mapped_blocks(graph_of, transports, name):
    graph = graph_of(*DEPLOYMENTS[name], *SMALL)
    assert graph.validate() == []
    ids, dst = run_cut(graph, transports)
    assert wrong_units(graph, ids, dst) == []


def test_a_plan_sent_to_the_wrong_rank_is_caught(graph_of, transports):
    """The silent failure: consumer rank c gets rank c+1's heads; nothing errors."""
    from dataclasses import replace

    graph = graph_of(*DEPLOYMENTS["pp4->tp4"], *SMALL)
    n = len(graph.consumer.ranks)

    def shifted(cut):
        return replace(cut, consumer_rank=(cut.consumer_rank + 1) % n)

    ids, dst = run_cut(graph, transports, plan_for=shifted)
    assert len(wrong_units(graph, ids, dst)) == sum(len(r.units) for r in graph.consumer.ranks)


def test_descriptors_merge_runs_contiguous_on_both_sides(graph_of):
    """TP4 -> TP4 moves whole blocks: one run per block, and consecutive block pairs merge."""
    from pdflow.transfer.descriptors import UnitRegion

    graph = graph_of("prefill=tp4", "decode=tp4", *SMALL[1:], "drafter=none")
    cut = graph.cut(0, 0)
    units = {n for g in cut.groups for pair in g.units for n in pair}
    bpb = {u.name: u.bytes_per_block for u in graph.consumer.ranks[0].units}
    src = {n: UnitRegion(base=(i + 1) << 32, block_bytes=bpb[n], num_blocks=8) for i, n in enumerate(sorted(units))}
    dst = {n: UnitRegion(base=(i + 1) << 40, block_bytes=bpb[n], num_blocks=8) for i, n in enumerate(sorted(units))}
    scattered = block_descriptors(cut, src, dst, [1, 5], [2, 0])
    runs = sum(len(g.runs) * len(g.units) for g in cut.groups)
    assert len(scattered) == 2 * runs
    contiguous = block_descriptors(cut, src, dst, [1, 2, 3], [4, 5, 6])
    assert len(contiguous) == runs and contiguous.nbytes == 3 * cut.bytes_per_block
    with pytest.raises(IndexError):
        block_descriptors(cut, src, dst, [8], [0])


def test_a_write_mooncake_rejects_raises(transports):
    a, b = transports(), transports()
    buf = torch.zeros(1024, dtype=torch.int16)
    a.register(buf)
    from pdflow.transfer.descriptors import Descriptors

    desc = Descriptors()
    desc.add(buf.data_ptr(), 12345678, 64)  # not inside any buffer b registered
    with pytest.raises(TransferError, match="returned"):
        a.write(b.session_id, desc)
    with pytest.raises(TransferError):
        a.write("127.0.0.1:1", desc)  # nobody listens there
