"""Pairing on the served path: a producer rank's ``KVLink`` checks every consumer rank's
``KVEndpoint`` against its own plan and refuses a mismatch with the graph's refusal code
before a byte moves (``worker/kv_link.endpoint_refusals``).

Each wrong consumer is a consistent deployment of its own (both sides changed), so the
only disagreement is between the producer's plan and what the consumer publishes."""

from __future__ import annotations

import pytest
from msgspec.structs import replace
from transfer_kit import caches_for

from pdflow.graph import CONSUMER, PRODUCER
from pdflow.graph.refusals import PAIRING_ONLY, Code
from pdflow.parallel.messages import KVEndpoint, UnitAddress
from pdflow.transfer.errors import PairingRefused
from pdflow.worker.kv_link import KVLink, endpoint_refusals

BASE = ["prefill=pp4", "decode=tp4", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "transfer=nccl", "transfer.staging_mib=2"]
LAST_STAGE = 3  # holds the drafter, so it also sends draft units
WRONG = {
    Code.UNIT_MISMATCH_HEAD_DIM: ["model.path=null", "model.head_dim=32"],
    Code.UNIT_MISMATCH_DTYPE: ["prefill.kv_dtype=bf16", "decode.kv_dtype=bf16"],
    Code.UNIT_MISMATCH_PAGE: ["prefill.kv_page_tokens=128", "decode.kv_page_tokens=128"],
    Code.UNIT_MISMATCH_BLOCK: ["prefill.block_size=64", "decode.block_size=64"],
    Code.UNIT_MISMATCH_HEADS: ["decode=tp2"],
    Code.REGION_MISSING: ["drafter=none"],
}


def endpoint_of(graph, rank: int) -> KVEndpoint:
    """The endpoint a consumer rank of ``graph`` would publish (addresses made up)."""
    units = graph.consumer.ranks[rank].units
    return KVEndpoint(rank=rank, session_id="127.0.0.1:1", device="cpu", units=[
        UnitAddress(name=u.name, base=(i + 1) << 24, block_bytes=u.bytes_per_block, num_blocks=4, chunk_blocks=0,
                    family=u.family, field=u.field, layer=u.layer, heads=list(u.heads), head_dim=u.head_dim,
                    dtype=u.dtype, page_tokens=u.page_tokens, block_size=u.block_size)
        for i, u in enumerate(units)])


def refusals_of(graph, producer_rank: int, endpoint: KVEndpoint):
    """What ``KVLink.pair`` checks for one (producer rank, consumer rank) cut."""
    cut = graph.cut(producer_rank, endpoint.rank)
    written = {dst for g in cut.groups for _, dst in g.units}
    expected = {u.name: u for u in graph.rank(CONSUMER, endpoint.rank).units if u.name in written}
    return endpoint_refusals(expected, endpoint, f"decode:{endpoint.rank}")


def test_the_plans_own_consumer_is_accepted(graph_of):
    graph = graph_of(*BASE)
    for cut in graph.cuts:
        assert refusals_of(graph, cut.producer_rank, endpoint_of(graph, cut.consumer_rank)) == []


@pytest.mark.parametrize("code", list(WRONG), ids=str)
def test_a_disagreeing_consumer_is_refused_with_the_graphs_code(graph_of, code):
    graph, other = graph_of(*BASE), graph_of(*BASE, *WRONG[code])
    assert other.validate() == []  # the wrong consumer is a fine deployment on its own
    refusals = refusals_of(graph, LAST_STAGE, endpoint_of(other, 0))
    assert code in {r.code for r in refusals}, refusals
    assert all(r.fix for r in refusals)


def test_pairing_only_codes_through_a_producer_ranks_link(graph_of):
    """The rank's own ``pair``: a consumer rank missing from the endpoints, and a region
    whose block size disagrees, are refused by code before any pair is made."""
    graph = graph_of(*BASE)
    rank = graph.rank(PRODUCER, 0)
    link = KVLink(graph, PRODUCER, 0, caches_for(rank.units, 4, fill="random"))
    endpoints = [endpoint_of(graph, r.rank) for r in graph.consumer.ranks]
    got = {}
    with pytest.raises(PairingRefused) as unknown:
        link.pair(endpoints[1:])
    got[Code.PAIRING_RANK_UNKNOWN] = unknown.value.refusals
    halved = replace(endpoints[0], units=[replace(u, block_bytes=u.block_bytes // 2) for u in endpoints[0].units])
    with pytest.raises(PairingRefused) as bad_region:
        link.pair([halved, *endpoints[1:]])
    got[Code.PAIRING_REGION_INVALID] = bad_region.value.refusals
    link.close()
    # PAIRING_PEER_FAILED (a point-to-point pair the consumer could not set up) is raised
    # through the KV links: test_transfer_p2p.test_a_failed_pair_is_a_named_refusal_...
    assert set(got) | {Code.PAIRING_PEER_FAILED} == PAIRING_ONLY
    assert [r.code for r in got[Code.PAIRING_RANK_UNKNOWN]] == [Code.PAIRING_RANK_UNKNOWN]
    assert {r.code for r in got[Code.PAIRING_REGION_INVALID]} == {Code.PAIRING_REGION_INVALID}
    assert not link.paired()  # refused: nothing paired, nothing to write to
