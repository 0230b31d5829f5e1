"""Requests moved end to end between the two instances of a P/D graph, in one process:
pairing and per-request messages over the real ZMQ side channel, bytes over the real
Mooncake Transfer Engine (TCP loopback), packed or direct, into poisoned consumer caches.

Producer caches hold random bytes; the oracle (``transfer_kit.expected_consumer``)
takes each consumer rank's heads of each mapped block from the producer rank holding
them by tensor indexing over the unit layout, independent of the byte runs the graph
computes. Every other byte must keep its poison.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import transfer_kit
from transfer_kit import Rig, needs_mooncake, wrong_units

pytestmark = needs_mooncake
transports = transfer_kit.transports  # the pooled-engine fixture
one_torch_thread = transfer_kit.one_torch_thread

NUM_BLOCKS = 6
REQUESTS = {"a": ([4, 0, 3], [1, 5, 2]), "b": ([1, 2], [0, 3])}
DEPLOYMENTS = {
    "pp4->tp4": ["prefill=pp4", "decode=tp4"],
    "pp2->tp2": ["prefill=pp2", "decode=tp2"],
    "tp2->tp4": ["prefill=tp2", "decode=tp4"],
    "tp4->tp2": ["prefill=tp4", "decode=tp2"],
}


def overrides(page: int, staging: bool, staging_mib: int = 16) -> list[str]:
    return [f"prefill.kv_page_tokens={page}", f"decode.kv_page_tokens={page}",
            f"transfer.staging={str(staging).lower()}", f"transfer.staging_mib={staging_mib}",
            "transfer.timeout_s=20"]


def run(graph, transports, **rig_args):
    rig = Rig(graph, NUM_BLOCKS, transports, **rig_args)
    try:
        rig.pair()
        outcomes = rig.move(REQUESTS)
        return rig, outcomes
    finally:
        rig.close()


@pytest.mark.parametrize("path", ["packed", "direct"])
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_every_consumer_rank_holds_exactly_its_heads_of_the_mapped_blocks(graph_of, transports, name, page, path):
    graph = graph_of(*DEPLOYMENTS[name], *overrides(page, path == "packed"))
    assert graph.validate() == []
    rig, outcomes = run(graph, transports)
    assert len(outcomes) == len(REQUESTS) * len(graph.consumer.ranks)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values() if not o.ok]
    assert wrong_units(graph, rig.producer_caches, rig.consumer_caches, REQUESTS.values()) == []
    assert all(bool(w.recv_addr) == (path == "packed") for w in rig.wants)
    packed_slots = sum(imp.receive.arena.used if imp.receive else 0 for imp in rig.importers.values())
    assert packed_slots == 0  # every slot was released after its scatter


def test_packed_and_direct_leave_identical_caches(graph_of, transports):
    """Byte-identical consumer caches from both paths, from the same producer bytes."""
    import torch

    results = {}
    for path in ("packed", "direct"):
        graph = graph_of(*DEPLOYMENTS["pp2->tp2"], *overrides(16, path == "packed"))
        rig, outcomes = run(graph, transports)
        assert all(o.ok for o in outcomes.values())
        results[path] = rig.consumer_caches
    for rank, caches in results["packed"].items():
        for name, cache in caches.items():
            assert torch.equal(cache.view(torch.uint8), results["direct"][rank][name].view(torch.uint8)), name


@pytest.mark.parametrize("path", ["packed", "direct"])
def test_the_page_ignorant_cut_is_caught(graph_of, transports, path):
    """The silent failure: cutting page-16 units as if the page were the whole block
    hands each consumer rank other heads' bytes, and every transfer reports success."""
    graph = graph_of(*DEPLOYMENTS["pp4->tp4"], *overrides(16, path == "packed"))
    ignorant = graph_of(*DEPLOYMENTS["pp4->tp4"], *overrides(128, path == "packed"), "drafter.page_tokens=128")
    assert [c.descriptors_per_block for c in ignorant.cuts] != [c.descriptors_per_block for c in graph.cuts]
    wrong = replace(graph, cuts=ignorant.cuts)
    rig, outcomes = run(wrong, transports)
    assert all(o.ok for o in outcomes.values())  # nothing errors, yet every unit is wrong
    bad = wrong_units(graph, rig.producer_caches, rig.consumer_caches, REQUESTS.values())
    assert len(bad) == sum(len(r.units) for r in graph.consumer.ranks)


def test_streaming_through_a_send_buffer_smaller_than_a_request(graph_of, transports):
    """Packed requests larger than the producer's send buffer go out in several writes,
    alternating between its two halves."""
    graph = graph_of(*DEPLOYMENTS["tp2->tp4"], *overrides(16, True))
    rig, outcomes = run(graph, transports, send_buffer_bytes=80 << 10)
    assert all(o.ok for o in outcomes.values())
    biggest = max(w.recv_bytes for w in rig.wants)
    assert biggest > 8 * (40 << 10)  # so the largest request took at least nine writes
    assert wrong_units(graph, rig.producer_caches, rig.consumer_caches, REQUESTS.values()) == []


def test_a_full_receive_area_falls_back_to_direct_writes(graph_of, transports):
    graph = graph_of(*DEPLOYMENTS["tp2->tp4"], *overrides(16, True, staging_mib=1))
    rig = Rig(graph, NUM_BLOCKS, transports)
    try:
        rig.pair()
        importer = rig.importers[0]
        hog = importer.receive.arena.alloc(importer.receive.arena.nbytes)  # nothing left
        wanted = importer.expect("probe", [0])
        assert all(w.recv_addr == 0 for w in wanted.values())
        importer.cancel("probe")
        importer.receive.arena.free(hog)
        outcomes = rig.move(REQUESTS)
    finally:
        rig.close()
    assert all(o.ok for o in outcomes.values())
    assert wrong_units(graph, rig.producer_caches, rig.consumer_caches, REQUESTS.values()) == []
