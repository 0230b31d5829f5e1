"""Packing without an engine: gathering a request's runs into one buffer and scattering
them on the consumer leaves the consumer's caches byte-identical to copying every direct
descriptor (done here with memmove on the real addresses), and both match the oracle."""

from __future__ import annotations

import ctypes

import pytest
import torch
import transfer_kit
from transfer_kit import caches_for, wrong_units

from pdflow.transfer import packing
from pdflow.transfer.descriptors import UnitRegion, block_descriptors
from pdflow.transfer.p2p_parts import bad_blocks, copy_chunk

one_torch_thread = transfer_kit.one_torch_thread
NUM_BLOCKS = 5
SRC, DST = [3, 0, 4], [1, 4, 2]
CASES = {
    "pp4->tp4 page16": ["prefill=pp4", "decode=tp4", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"],
    "tp2->tp4 page16": ["prefill=tp2", "decode=tp4", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"],
    "tp4->tp2 page128": ["prefill=tp4", "decode=tp2"],
    "pp2->tp1 page16": ["prefill=pp2", "decode=tp1", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"],
}


def regions(caches):
    return {n: UnitRegion(base=c.data_ptr(), block_bytes=packing.block_bytes(c), num_blocks=c.shape[0])
            for n, c in caches.items()}


def move_all(graph, how: str):
    producer = {r.rank: caches_for(r.units, NUM_BLOCKS, fill="random", seed=r.rank + 1) for r in graph.producer.ranks}
    consumer = {r.rank: caches_for(r.units, NUM_BLOCKS, fill="poison") for r in graph.consumer.ranks}
    for cut in graph.cuts:
        src, dst = producer[cut.producer_rank], consumer[cut.consumer_rank]
        if how == "direct":
            desc = block_descriptors(cut, regions(src), regions(dst), SRC, DST)
            for s, d, n in zip(desc.src, desc.dst, desc.length, strict=True):
                ctypes.memmove(d, s, n)
        else:
            buf = torch.empty(packing.packed_nbytes(cut, len(SRC)), dtype=torch.uint8)
            whole = packing.pieces(cut, len(SRC))  # the pairs' CPU path, the request as one chunk
            copy_chunk(whole, buf, SRC, plan=cut, caches=src, reverse=False,
                       other_block_bytes={n: packing.block_bytes(c) for n, c in dst.items()})
            copy_chunk(whole, buf, DST, plan=cut, caches=dst, reverse=True,
                       other_block_bytes={n: packing.block_bytes(c) for n, c in src.items()})
    return producer, consumer


@pytest.mark.parametrize("case", list(CASES))
def test_packed_and_direct_paths_leave_identical_caches(graph_of, case):
    graph = graph_of(*CASES[case])
    producer, direct = move_all(graph, "direct")
    _, packed = move_all(graph, "packed")
    for rank, caches in direct.items():
        for name, cache in caches.items():
            assert torch.equal(cache.view(torch.uint8), packed[rank][name].view(torch.uint8)), name
    assert wrong_units(graph, producer, packed, [(SRC, DST)]) == []


def test_pieces_stream_the_same_bytes_as_one_pack(graph_of):
    graph = graph_of(*CASES["pp4->tp4 page16"])
    cut = graph.cuts[-1]  # the last stage: target and draft groups
    src = caches_for(graph.producer.ranks[cut.producer_rank].units, NUM_BLOCKS, fill="random")
    dst_bytes = {u.name: u.bytes_per_block for u in graph.consumer.ranks[cut.consumer_rank].units}
    whole = torch.empty(packing.packed_nbytes(cut, len(SRC)), dtype=torch.uint8)
    copy_chunk(packing.pieces(cut, len(SRC)), whole, SRC, plan=cut, caches=src, other_block_bytes=dst_bytes,
               reverse=False)
    per_block = max(sum(r.length for r in g.runs) for g in cut.groups)
    pieces = packing.pieces(cut, len(SRC), max_bytes=per_block * 2)
    assert len(pieces) > len(cut.groups) and all(p.nbytes <= per_block * 2 for p in pieces)
    assert [p.offset for p in pieces] == [sum(q.nbytes for q in pieces[:i]) for i in range(len(pieces))]
    streamed = torch.empty_like(whole)
    for p in pieces:
        packing.copy_piece(cut, p, src[p.src_unit], SRC, streamed[p.offset:p.offset + p.nbytes],
                           other_block_bytes=dst_bytes[p.dst_unit], reverse=False)
    assert torch.equal(whole, streamed)
    with pytest.raises(ValueError, match="exceed"):
        packing.pieces(cut, len(SRC), max_bytes=per_block - 1)


def test_scattering_refuses_repeated_or_out_of_pool_blocks():
    """Checked before a byte lands (``bad_blocks``): a repeated id would scatter twice, an
    out-of-range one writes outside the cache (on a GPU, takes the device context down)."""
    assert "repeat" in bad_blocks([1, 1], NUM_BLOCKS)
    assert "outside the pool" in bad_blocks([1, NUM_BLOCKS], NUM_BLOCKS)
    assert bad_blocks([4, 0, 2], NUM_BLOCKS) == ""
