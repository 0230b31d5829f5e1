"""The head cut checked against an independent brute force.

Every producer block is filled (with numpy, from the layout's definition, not from the
graph's run arithmetic) with values that encode (unit, head, token, dim); the graph's
planned runs are applied as raw byte copies into poisoned consumer buffers; then every
consumer rank must hold exactly its own heads, token for token.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdflow.graph import plan_runs
from pdflow.graph.units import UnitSpec

DEPLOYMENTS = {
    "tp1->tp4": ["prefill=tp1", "decode=tp4"],
    "tp2->tp4": ["prefill=tp2", "decode=tp4"],
    "tp4->tp2": ["prefill=tp4", "decode=tp2"],
    "tp4->tp8 (replicated heads)": ["prefill=tp4", "decode=tp8"],
    "pp4->tp4": ["prefill=pp4", "decode=tp4"],
    # Ten layers of tiny's shape: not the shipped checkpoint, so no model.path.
    "pp4 uneven->tp4": ["prefill=pp4-uneven", "decode=tp4", "model.layers=10", "model.path=null"],
    "pp2xtp2->tp4": ["prefill=pp2", "prefill.tp=2", "decode=tp4"],
}


def encode(unit_id: int, unit: UnitSpec) -> np.ndarray:
    """A block of ``unit`` as [pages, local heads, page_tokens, head_dim] int32 codes of
    (unit, global head, token in block, dim)."""
    pages, per_page = unit.pages_per_block, unit.page_tokens
    heads = unit.heads or (0,)
    head = np.array(heads, dtype=np.int64)[None, :, None, None]
    page = np.arange(pages)[:, None, None, None]
    tok = page * per_page + np.arange(per_page)[None, None, :, None]
    dim = np.arange(unit.head_dim)[None, None, None, :]
    code = ((unit_id * 64 + head) * unit.block_size + tok) * unit.head_dim + dim
    return code.astype(np.int32)


def as_bytes(unit: UnitSpec, codes: np.ndarray) -> np.ndarray:
    """Codes widened or narrowed to the unit's itemsize (fp8 units: low byte only)."""
    if unit.itemsize == 4:
        return codes.view(np.uint8).reshape(-1)
    return codes.astype(np.uint32).view(np.uint8).reshape(*codes.shape, 4)[..., : unit.itemsize].reshape(-1)


def transfer(graph, runs_for=None) -> tuple[dict[str, int], dict[tuple[int, str], np.ndarray]]:
    """Apply the graph's cut plans (or ``runs_for(src_unit, dst_unit, heads)``) byte by byte."""
    ids = {}
    src = {}
    for rank in graph.producer.ranks:
        for unit in rank.units:
            ids.setdefault(unit.name, len(ids))
            src[(rank.rank, unit.name)] = as_bytes(unit, encode(ids[unit.name], unit))
    dst = {
        (rank.rank, unit.name): np.full(unit.bytes_per_block, 0xAB, dtype=np.uint8)
        for rank in graph.consumer.ranks
        for unit in rank.units
    }
    for cut in graph.cuts:
        prank = graph.producer.ranks[cut.producer_rank]
        crank = graph.consumer.ranks[cut.consumer_rank]
        for group in cut.groups:
            for src_name, dst_name in group.units:
                runs = group.runs
                if runs_for is not None:
                    s, d = prank.unit(src_name), crank.unit(dst_name)
                    heads = tuple(h for h in d.heads if h in s.heads)
                    runs = runs_for(s, d, heads)
                buf, out = src[(prank.rank, src_name)], dst[(crank.rank, dst_name)]
                for run in runs:
                    out[run.dst : run.dst + run.length] = buf[run.src : run.src + run.length]
    return ids, dst


def wrong_ranks(graph, ids, dst) -> list[str]:
    """Consumer (rank, unit) buffers that do not hold exactly their own heads."""
    bad = []
    for rank in graph.consumer.ranks:
        for unit in rank.units:
            want = as_bytes(unit, encode(ids[unit.name], unit))
            if not np.array_equal(dst[(rank.rank, unit.name)], want):
                bad.append(f"{rank.label}:{unit.name}")
    return bad


@pytest.mark.parametrize("page", [128, 16])
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_every_consumer_rank_holds_exactly_its_heads(graph_of, name, page):
    graph = graph_of(
        *DEPLOYMENTS[name],
        f"prefill.kv_page_tokens={page}",
        f"decode.kv_page_tokens={page}",
        "drafter=dspark",
    )
    assert graph.validate() == []
    ids, dst = transfer(graph)
    assert wrong_ranks(graph, ids, dst) == []
    runs = {len(g.runs) for c in graph.cuts for g in c.groups if g.units[0][0].startswith("mha")}
    # One run per page (docs/ARCHITECTURE.md, 'KV units, pages and the head cut'), merged into one when both ranks hold exactly
    # the heads that move (each run's end then meets the next page's start).
    kv = graph.spec.model.kv_heads
    p_heads, c_heads = max(1, kv // graph.spec.prefill.tp), max(1, kv // graph.spec.decode.tp)
    assert runs == ({1} if p_heads == c_heads else {128 // page})


def test_reference_geometry_pp4_to_tp4_with_fp8_and_indexer(graph_of):
    graph = graph_of(
        "+experiment=ref_pp4_tp4_dspark",
        "model.layers=8",
        "model.indexer_layers=[0,2,4,6]",
        "drafter.taps=[1,3,5,7]",
    )
    assert graph.validate() == []
    ids, dst = transfer(graph)
    assert wrong_ranks(graph, ids, dst) == []


def page_ignorant_runs(src: UnitSpec, dst: UnitSpec, heads):
    """The bug the reference deployment's second row shipped: cut as if page == block."""
    fake_src = replace(src, page_tokens=src.block_size)
    fake_dst = replace(dst, page_tokens=src.block_size)
    return plan_runs(fake_src, fake_dst, heads)


def test_page_ignorant_cut_is_caught(graph_of):
    graph = graph_of("prefill=pp4", "decode=tp4", "drafter=dspark")  # draft page 16
    ids, dst = transfer(graph, runs_for=page_ignorant_runs)
    bad = wrong_ranks(graph, ids, dst)
    # Target units (page 128 == block) survive; every draft unit on every rank is wrong.
    assert bad and all(".draft." in f".{b.split(':')[1]}" for b in bad)
    assert len(bad) == 4 * 2 * graph.spec.drafter.layers
    # The same bug on a page-16 target binding corrupts the target heads too.
    graph16 = graph_of("prefill=tp1", "decode=tp4", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16")
    ids, dst = transfer(graph16, runs_for=page_ignorant_runs)
    assert any(".mha." in f".{b.split(':')[1]}" for b in wrong_ranks(graph16, ids, dst))


def test_head_major_runs_one_per_page():
    unit = UnitSpec(
        family="mha",
        field="k",
        layer=0,
        heads=(0, 1, 2, 3),
        head_dim=64,
        dtype="bf16",
        page_tokens=16,
        block_size=128,
    )
    runs = unit.head_major_runs(range(2, 3))
    assert len(runs) == 8
    span = 16 * 64 * 2
    assert [r.offset for r in runs] == [((p * 4) + 2) * span for p in range(8)]
    assert {r.length for r in runs} == {span}
