"""A producer rank's peer table: one producer rank writes into several consumer instances,
each paired once under its id, exports for different consumers interleaved with nothing
drained; each consumer's ranks hold exactly their heads of the blocks written to them
(the tensor-indexing oracle of ``transfer_kit``) and nothing else; an export naming a
consumer that never paired fails instead of landing nowhere; forgetting a consumer closes
its pairs and leaves the others'."""

from __future__ import annotations

import pytest
from transfer_kit import caches_for, producer_caches_of, sessions_end, wrong_units

from pdflow.graph import CONSUMER, PRODUCER
from pdflow.parallel.messages import KVExport
from pdflow.transfer.errors import TransferError
from pdflow.transfer.grants import kv_nonce, new_key
from pdflow.worker.kv_link import KVLink
from pdflow.worker.kv_sender import KVSender

NUM_BLOCKS = 6
BASE = ["transfer=nccl", "transfer.timeout_s=10", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.block_size=32", "decode.block_size=32", "prefill=tp1", "decode=tp2", "drafter=none"]
# Per consumer instance: its requests, (producer blocks, consumer blocks).
REQUESTS = {"d0": [([4, 0, 3], [1, 5, 2]), ([5], [0])], "d1": [([1, 2], [0, 3]), ([3, 4], [4, 1])]}


class Consumer:
    """One consumer instance in this process: a KV link per rank, poisoned caches, its key."""

    def __init__(self, graph):
        self.key = new_key()
        self.caches = {r.rank: caches_for(r.units, NUM_BLOCKS, fill="poison") for r in graph.consumer.ranks}
        self.links = [KVLink(graph, CONSUMER, r, c) for r, c in self.caches.items()]

    def endpoints(self):
        return [link.open(self.key) for link in self.links]


@pytest.fixture
def two_consumers(graph_of):
    graph = graph_of(*BASE)
    consumers = {cid: Consumer(graph) for cid in REQUESTS}
    sources = producer_caches_of(graph, NUM_BLOCKS)
    producer = KVLink(graph, PRODUCER, 0, sources[0])
    try:
        yield graph, consumers, sources, producer
    finally:
        for link in (producer, *(lk for c in consumers.values() for lk in c.links)):
            link.close()


def _export(cid: str, consumer: Consumer, i: int, src, dst) -> KVExport:
    return KVExport(request_id=f"{cid}-{i}", consumer=cid, nonce=kv_nonce(consumer.key, dst),
                    src_blocks=list(src), dst_blocks=list(dst))


def test_one_producer_rank_writes_interleaved_into_two_consumers(two_consumers):
    graph, consumers, sources, producer = two_consumers
    producer.pair(consumers["d0"].endpoints(), "d0")
    first = producer.consumers["d0"]
    producer.pair(consumers["d1"].endpoints(), "d1")
    assert producer.consumers["d0"] is first  # the second pairing left the first's peers alone
    assert producer.consumer_ranks == [0, 1]
    for i in range(2):  # d0, d1, d0, d1: no drain between consumers
        for cid, consumer in consumers.items():
            src, dst = REQUESTS[cid][i]
            for rank in producer.consumer_ranks:
                producer.send(rank, _export(cid, consumer, i, src, dst))
    for cid, consumer in consumers.items():
        assert wrong_units(graph, sources, consumer.caches, REQUESTS[cid]) == [], cid


def test_exports_for_two_consumers_in_one_step_land_through_the_sender(two_consumers):
    """The sender splits a step's exports by consumer and routes each to the ranks of the
    consumer it names."""
    graph, consumers, sources, producer = two_consumers
    for cid, consumer in consumers.items():
        producer.pair(consumer.endpoints(), cid)
    sender = KVSender(producer, role=PRODUCER, rank=0, device=sources[0][next(iter(sources[0]))].device)
    try:
        exports = [_export(cid, c, i, *REQUESTS[cid][i]) for i in range(2) for cid, c in consumers.items()]
        sender.start(exports)
        sender.drain(timeout_s=60)
        sents = sender.settled()  # one report per consumer: each consumer's thread sends its own
        assert len(sents) == 2 and all(sent.failed == {} for sent in sents)
        assert sorted(r for sent in sents for r in sent.request_ids) == sorted(e.request_id for e in exports)
        assert {sent.request_ids[0][:2] for sent in sents} == {"d0", "d1"}
        assert all(len({r[:2] for r in sent.request_ids}) == 1 for sent in sents)
    finally:
        sender.close()
    for cid, consumer in consumers.items():
        assert wrong_units(graph, sources, consumer.caches, REQUESTS[cid]) == [], cid


def test_an_export_for_a_consumer_that_never_paired_fails(two_consumers):
    """Without the peer table's check the export would 'succeed' with nothing written."""
    graph, consumers, sources, producer = two_consumers
    producer.pair(consumers["d0"].endpoints(), "d0")
    stray = _export("d1", consumers["d1"], 0, *REQUESTS["d1"][0])
    with pytest.raises(TransferError, match="has not paired with consumer 'd1'"):
        producer.send(0, stray)
    sender = KVSender(producer, role=PRODUCER, rank=0, device=sources[0][next(iter(sources[0]))].device)
    try:
        sender.start([stray])
        sender.drain(timeout_s=60)
        (sent,) = sender.settled()
        assert "has not paired" in sent.failed[stray.request_id]
    finally:
        sender.close()
    assert wrong_units(graph, sources, consumers["d1"].caches, []) == []  # d1 still all poison


def test_pairing_a_consumer_again_replaces_only_its_peers(two_consumers):
    graph, consumers, sources, producer = two_consumers
    producer.pair(consumers["d0"].endpoints(), "d0")
    producer.pair(consumers["d1"].endpoints(), "d1")
    kept, old = producer.consumers["d0"], producer.consumers["d1"]
    producer.pair(consumers["d1"].endpoints(), "d1")
    assert producer.consumers["d0"] is kept and producer.consumers["d1"] is not old
    src, dst = REQUESTS["d1"][0]
    for rank in producer.consumer_ranks:
        producer.send(rank, _export("d1", consumers["d1"], 0, src, dst))
    assert wrong_units(graph, sources, consumers["d1"].caches, [REQUESTS["d1"][0]]) == []


def test_forgetting_a_consumer_closes_only_its_peers(two_consumers):
    """A consumer that stopped leaves the table, and its pairs close (each consumer rank's
    session ends); the other consumer's peers stay and still land. Without ``forget``'s
    close the gone consumer's sessions (and the producer's sockets, staging) would stay."""
    graph, consumers, sources, producer = two_consumers
    producer.pair(consumers["d0"].endpoints(), "d0")
    producer.pair(consumers["d1"].endpoints(), "d1")
    kept, gone = producer.consumers["d0"], producer.consumers["d1"]
    assert all(len(link.listener._sessions) == 1 for c in consumers.values() for link in c.links)
    assert producer.forget("d1") and not producer.forget("d1")
    assert producer.consumers == {"d0": kept}
    assert all(peer.conn.sock.fileno() == -1 for peer in gone.p2p.values())  # the producer's ends closed
    assert sessions_end(link.listener for link in consumers["d1"].links)  # and the consumer's ranks saw them go
    assert all(len(link.listener._sessions) == 1 for link in consumers["d0"].links)
    with pytest.raises(TransferError, match="has not paired with consumer 'd1'"):
        producer.send(0, _export("d1", consumers["d1"], 0, *REQUESTS["d1"][0]))
    for i, (src, dst) in enumerate(REQUESTS["d0"]):
        for rank in producer.consumer_ranks:
            producer.send(rank, _export("d0", consumers["d0"], i, src, dst))
    assert wrong_units(graph, sources, consumers["d0"].caches, REQUESTS["d0"]) == []
    producer.pair(consumers["d1"].endpoints(), "d1")  # a consumer forgotten in error pairs again
    src, dst = REQUESTS["d1"][0]
    for rank in producer.consumer_ranks:
        producer.send(rank, _export("d1", consumers["d1"], 0, src, dst))
    assert wrong_units(graph, sources, consumers["d1"].caches, [REQUESTS["d1"][0]]) == []
