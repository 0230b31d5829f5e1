"""Pairing: a consumer rank whose units or memory disagree with the producer's plan is
refused at pairing, with the graph's refusal code, and nothing is ever written to it.

Each wrong consumer is a consistent deployment of its own (both sides changed), so the
only disagreement is between the producer's plan and what the consumer publishes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transfer_kit
from msgspec.structs import replace
from transfer_kit import POISON, Rig, caches_for, needs_mooncake

from pdflow.graph.refusals import PAIRING_ONLY, Code
from pdflow.transfer import Endpoint, KVImporter, PairingRefused, check_hello, pair_with_producers
from pdflow.transfer.descriptors import UnitRegion
from pdflow.transfer.messages import Area, Hello

BASE = ["prefill=pp4", "decode=tp4", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "transfer.staging_mib=2"]
LAST_STAGE = 3  # holds the drafter, so it also sends draft units
WRONG = {
    Code.UNIT_MISMATCH_HEAD_DIM: ["model.path=null", "model.head_dim=32"],
    Code.UNIT_MISMATCH_DTYPE: ["prefill.kv_dtype=bf16", "decode.kv_dtype=bf16"],
    Code.UNIT_MISMATCH_PAGE: ["prefill.kv_page_tokens=128", "decode.kv_page_tokens=128"],
    Code.UNIT_MISMATCH_BLOCK: ["prefill.block_size=64", "decode.block_size=64"],
    Code.UNIT_MISMATCH_HEADS: ["decode=tp2"],
    Code.REGION_MISSING: ["drafter=none"],
}
transports = transfer_kit.transports  # the pooled-engine fixture
one_torch_thread = transfer_kit.one_torch_thread


def hello_of(graph, rank: int, **changes) -> Hello:
    """The Hello a consumer rank of ``graph`` would publish (addresses made up)."""
    units = graph.consumer.ranks[rank].units
    regions = {u.name: UnitRegion(base=(i + 1) << 24, block_bytes=u.bytes_per_block, num_blocks=4)
               for i, u in enumerate(units)}
    hello = Hello(instance="decode-0", rank=rank, session_id="127.0.0.1:1", reply_to="tcp://127.0.0.1:1",
                  units=list(units), regions=regions, probe=Area(base=1 << 40, nbytes=256),
                  receive=Area(base=1 << 41, nbytes=1 << 20))
    return replace(hello, **changes) if changes else hello


def test_the_plans_own_consumer_is_accepted(graph_of):
    graph = graph_of(*BASE)
    for producer in range(len(graph.producer.ranks)):
        for consumer in range(len(graph.consumer.ranks)):
            assert check_hello(graph, producer, hello_of(graph, consumer)) == []


@pytest.mark.parametrize("code", list(WRONG), ids=str)
def test_a_disagreeing_consumer_is_refused_with_the_graphs_code(graph_of, code):
    graph, other = graph_of(*BASE), graph_of(*BASE, *WRONG[code])
    assert other.validate() == []  # the wrong consumer is a fine deployment on its own
    refusals = check_hello(graph, LAST_STAGE, hello_of(other, 0))
    assert code in {r.code for r in refusals}, refusals
    assert all(r.fix for r in refusals)


def test_pairing_only_codes(graph_of):
    graph = graph_of(*BASE)
    hello = hello_of(graph, 0)
    unknown = check_hello(graph, 0, replace(hello, rank=9))
    bad_region = replace(hello, regions={n: dataclasses.replace(r, block_bytes=r.block_bytes // 2)
                                         for n, r in hello.regions.items()})
    no_receive = replace(hello, receive=None)
    got = {
        Code.PAIRING_RANK_UNKNOWN: unknown,
        Code.PAIRING_REGION_INVALID: check_hello(graph, 0, bad_region) + check_hello(graph, 0, no_receive),
    }
    # PAIRING_PEER_FAILED (a point-to-point pair the consumer could not set up) is raised
    # through the KV links: test_transfer_p2p.test_a_failed_pair_is_a_named_refusal_...
    assert set(got) | {Code.PAIRING_PEER_FAILED} == PAIRING_ONLY
    assert [r.code for r in unknown] == [Code.PAIRING_RANK_UNKNOWN]
    assert {r.code for r in got[Code.PAIRING_REGION_INVALID]} == {Code.PAIRING_REGION_INVALID}
    assert len(got[Code.PAIRING_REGION_INVALID]) == len(graph.cut(0, 0).groups[0].units) + 1


@needs_mooncake
def test_a_refused_consumer_gets_the_code_over_the_side_channel_and_no_bytes(graph_of, transports):
    """A consumer rank built for page 128 pairs with page-16 producers: every producer
    rank refuses it; a request it sends anyway is answered with an error, and its caches
    keep their poison."""
    graph = graph_of(*BASE)
    rig = Rig(graph, 4, transports)
    other = graph_of(*BASE, *WRONG[Code.UNIT_MISMATCH_PAGE])
    endpoint = Endpoint()
    caches = caches_for(other.consumer.ranks[0].units, 4, fill="poison")
    importer = KVImporter(other, 0, caches, transports(other.spec.transfer), instance="decode-0",
                          reply_to=endpoint.address)
    try:
        producers = {p: rig.producer_address(p) for p in importer.cuts}
        with pytest.raises(PairingRefused) as refused:
            pair_with_producers(endpoint, importer.hello(), producers, timeout_s=10)
        assert {r.code for r in refused.value.refusals} == {Code.UNIT_MISMATCH_PAGE}
        rig.blocks["r"] = [0, 1]
        for p, want in importer.expect("r", [2, 3]).items():
            endpoint.send(producers[p], want)
        answers = [endpoint.recv(5.0) for _ in producers]
    finally:
        endpoint.close()
        importer.close()
        rig.close()
    assert [a.ok for a in answers] == [False] * len(producers)
    assert all("has not paired" in a.error for a in answers)
    assert all(torch.all(c.view(torch.uint8) == POISON) for c in caches.values())
