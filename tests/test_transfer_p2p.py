"""``transfer=nccl``: two-sided point-to-point pairs (Gloo on CPU, the same protocol NCCL
and CUDA IPC run on GPUs). Each consumer rank must hold exactly its heads of the mapped
blocks (the tensor-indexing oracle of ``transfer_kit``), also when a request spans several
chunks of the receive buffer; the page-ignorant cut is caught by the same oracle; bad block
ids and a lost consumer fail the request without a hang; and P/D through ``Deployment``
gives one process's greedy tokens.
"""

from __future__ import annotations

import time

import pytest
import torch
import transfer_kit
from transfer_kit import KEY, PAIRING, caches_for, producer_caches_of, send, wrong_units

from pdflow import Deployment, SamplingParams, compose
from pdflow.graph import CONSUMER, PRODUCER, Code
from pdflow.transfer import p2p
from pdflow.transfer.errors import PairingRefused, TransferError
from pdflow.transfer.grants import kv_nonce
from pdflow.transfer.movers.group import GroupSender, pair_group
from pdflow.transfer.p2p import P2PListener, P2PPeer, chunks
from pdflow.transfer.p2p_messages import P2PRequest, PeerClosed
from pdflow.transfer.p2p_parts import peer_closed
from pdflow.transfer.packing import packed_nbytes
from pdflow.worker.kv_link import KVLink

one_torch_thread = transfer_kit.one_torch_thread
transports = transfer_kit.transports  # pooled Mooncake engines
NUM_BLOCKS = 6
REQUESTS = {"a": ([4, 0, 3], [1, 5, 2]), "b": ([1, 2], [0, 3])}
BASE = ["transfer=nccl", "transfer.timeout_s=10", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.block_size=32", "decode.block_size=32"]


class Pairs:
    """Every producer rank paired with every consumer rank its cut plans name, in one
    process: listeners on loopback and the real protocol, bytes over Gloo groups (a
    FileStore rendezvous) or, with ``make_transport``, written by one Mooncake engine per
    rank into the consumer's registered staging."""

    def __init__(self, graph, *, buffer_bytes: int | None = None, make_transport=None):
        self.graph = graph
        self.producer_caches = producer_caches_of(graph, NUM_BLOCKS)
        self.consumer_caches = {r.rank: caches_for(r.units, NUM_BLOCKS, fill="poison")
                                for r in graph.consumer.ranks}
        spec = graph.spec.transfer

        def engine():
            return make_transport(spec) if make_transport else None

        self.listeners = {c: P2PListener(key=KEY, graph=graph, rank=c, caches=caches, spec=spec, buffer_bytes=buffer_bytes,
                                         transport=engine())
                          for c, caches in self.consumer_caches.items()}
        producer_engines = {r.rank: engine() for r in graph.producer.ranks}
        self.peers = {}
        for cut in graph.cuts:
            caches = self.producer_caches[cut.producer_rank]
            plan = cut.over(set(caches))
            consumer = graph.rank(CONSUMER, cut.consumer_rank)
            self.peers[cut.producer_rank, cut.consumer_rank] = P2PPeer(
                pairing=PAIRING, address=self.listeners[cut.consumer_rank].address, consumer_device="cpu", plan=plan, caches=caches,
                dst_block_bytes={u.name: u.bytes_per_block for u in consumer.units},
                producer_rank=cut.producer_rank, spec=spec, transport=producer_engines[cut.producer_rank])

    def move(self, requests=REQUESTS) -> None:
        for src, dst in requests.values():
            for peer in self.peers.values():
                send(peer, src, dst)

    def close(self) -> None:
        for part in (*self.peers.values(), *self.listeners.values()):
            part.close()


@pytest.fixture
def pairs_of(graph_of):
    made = []

    def make(*overrides, **kwargs):
        made.append(Pairs(graph_of(*BASE, *overrides), **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("layout", [["prefill=pp2", "decode=tp2", "drafter=dspark"],
                                    ["prefill=tp2", "decode=tp4", "drafter=none"]], ids=["pp2->tp2", "tp2->tp4"])
def test_every_consumer_rank_holds_exactly_its_heads(pairs_of, layout):
    pairs = pairs_of(*layout)
    pairs.move()
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []
    assert sum(lis.landed for lis in pairs.listeners.values()) == len(REQUESTS) * len(pairs.peers)


def test_a_request_larger_than_the_receive_buffer_moves_in_chunks(pairs_of, graph_of):
    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=dspark")
    cut = graph.cuts[0]
    per_block = packed_nbytes(cut, 1)
    buffer_bytes = 2 * per_block  # a 3-block request needs at least two chunks
    assert len(chunks(cut, 3, buffer_bytes)) >= 2
    pairs = pairs_of("prefill=pp2", "decode=tp2", "drafter=dspark", buffer_bytes=buffer_bytes)
    pairs.move()
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []


@pytest.mark.parametrize("ramp", [0, 2, 3])
def test_chunk_ramp_covers_the_stream_in_order_small_at_both_ends(graph_of, ramp):
    """A pipelined request's chunks: the whole packed stream once, in order, none above the
    half buffer; with a ramp the first and last are the smallest (fill and drain)."""
    cut = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=dspark").cuts[0]
    blocks, half = 64, 16 * packed_nbytes(cut, 1)
    parts = chunks(cut, blocks, half, ramp)
    flat = [p for c in parts for p in c]
    assert [p.offset for p in flat] == [sum(q.nbytes for q in flat[:i]) for i in range(len(flat))]
    assert sum(p.nbytes for p in flat) == packed_nbytes(cut, blocks)
    sizes = [sum(p.nbytes for p in c) for c in parts]
    assert max(sizes) <= half
    if ramp:
        assert sizes[0] <= half >> ramp and sizes[-1] < max(sizes) and sizes[0] < sizes[1] < sizes[2]
    else:
        assert max(sizes) - min(sizes) <= packed_nbytes(cut, 1)  # even, to a block


def test_ramped_chunks_land_every_head(pairs_of, graph_of):
    """A ramped request (ramp 3, a 2-block half buffer: chunks of differing sizes) lands
    exactly, over the same two-halves pipeline NCCL runs."""
    layout = ("prefill=pp2", "decode=tp2", "drafter=dspark", "transfer.chunk_ramp=3")
    per_block = packed_nbytes(graph_of(*BASE, *layout).cuts[0], 1)
    pairs = pairs_of(*layout, buffer_bytes=4 * per_block)
    whole = {"all": (list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS))[::-1])}
    assert len(chunks(pairs.graph.cuts[0], NUM_BLOCKS, 2 * per_block, 3)) >= 3
    pairs.move(whole)
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, whole.values()) == []


@transfer_kit.needs_mooncake
def test_mooncake_staging_lands_every_head_in_chunks(graph_of, transports):
    """transfer=mooncake_tcp (staging): packed runs written into the consumer's registered
    host staging by Mooncake, then scattered: the path GPU caches take through a TCP-only
    cluster (there with a device-to-host copy before the write and host-to-device after)."""
    graph = graph_of("transfer=mooncake_tcp", "transfer.timeout_s=10", "prefill.kv_page_tokens=16",
                     "decode.kv_page_tokens=16", "prefill.block_size=32", "decode.block_size=32",
                     "prefill=pp2", "decode=tp2", "drafter=dspark")
    per_block = packed_nbytes(graph.cuts[0], 1)
    pairs = Pairs(graph, buffer_bytes=2 * per_block, make_transport=transports)
    try:
        assert {p.mover for p in pairs.peers.values()} == {"mooncake"}
        pairs.move()
        assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []
        peer = next(iter(pairs.peers.values()))
        with pytest.raises(TransferError, match="outside the pool"):
            send(peer, [0], [NUM_BLOCKS])
    finally:
        pairs.close()


@transfer_kit.needs_mooncake
def test_a_request_the_consumer_fails_mid_stream_ends_there_and_the_pair_serves_on(graph_of, transports):
    """Pairs that ack every chunk (Mooncake staging; CUDA IPC on one GPU): the consumer
    fails a request of several chunks at its first (a block outside its pool). Both ends
    end the request at that ack; before, the consumer waited for the next chunk, read the
    next request in its place and closed the pair."""
    graph = graph_of("transfer=mooncake_tcp", "transfer.timeout_s=5", "prefill.kv_page_tokens=16",
                     "decode.kv_page_tokens=16", "prefill.block_size=32", "decode.block_size=32",
                     "prefill=pp2", "decode=tp2", "drafter=dspark")
    per_block = packed_nbytes(graph.cuts[0], 1)
    assert len(chunks(graph.cuts[0], 3, per_block)) >= 3
    pairs = Pairs(graph, buffer_bytes=per_block, make_transport=transports)
    try:
        _refuses_a_bad_block_then_lands_every_request(pairs)
    finally:
        pairs.close()


def _refuses_a_bad_block_then_lands_every_request(pairs) -> None:
    """A request naming a block outside the consumer's pool fails at its first chunk and
    the pair serves on: every request then lands exactly."""
    peer = next(iter(pairs.peers.values()))
    with pytest.raises(TransferError, match="outside the pool"):
        send(peer, [0, 1, 2], [0, 1, NUM_BLOCKS])
    pairs.move()
    assert not peer.broken
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []


def test_the_ipc_movers_ack_loop_lands_every_head_on_cpu(graph_of, monkeypatch):
    """The ``ipc`` mover's halves (the chunk-and-ack loop it shares with Mooncake staging,
    and the in-process handover of the consumer's receive buffer) run on CPU caches when
    both ends are told they share a GPU: several chunks per request land exactly, a bad
    block fails its request at the first ack and the pair serves on, and the consumer's
    session drops its in-process entry when the pair closes."""
    from pdflow.transfer import p2p_listener, p2p_parts

    monkeypatch.setattr(p2p, "choose_mover", lambda *_: "ipc")
    monkeypatch.setattr(p2p_listener, "device_identity", lambda _: "cuda:one-gpu")
    layout = ("prefill=pp2", "decode=tp2", "drafter=dspark")
    per_block = packed_nbytes(graph_of(*BASE, *layout).cuts[0], 1)
    before = set(p2p_parts.IN_PROCESS)
    pairs = Pairs(graph_of(*BASE, *layout), buffer_bytes=per_block)
    handed = set(p2p_parts.IN_PROCESS) - before
    try:
        assert {p.mover for p in pairs.peers.values()} == {"ipc"} and len(handed) == len(pairs.peers)
        _refuses_a_bad_block_then_lands_every_request(pairs)
    finally:
        pairs.close()
    deadline = time.monotonic() + 20
    while any(lis._sessions for lis in pairs.listeners.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not handed & set(p2p_parts.IN_PROCESS), "a closed pair's buffer stays in the in-process table"


def test_the_page_ignorant_cut_is_caught(pairs_of):
    pairs = pairs_of("prefill=pp2", "decode=tp2", "drafter=none", "transfer.force_page_ignorant_cut=[mha]")
    pairs.move()
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values())


def test_bad_block_ids_fail_the_request_and_the_pair_serves_on(pairs_of):
    pairs = pairs_of("prefill=pp2", "decode=tp2", "drafter=none")
    peer = next(iter(pairs.peers.values()))
    with pytest.raises(TransferError, match="outside the pool"):
        send(peer, [0, 1], [2, NUM_BLOCKS + 3])
    with pytest.raises(TransferError, match="repeat"):
        send(peer, [0, 1], [2, 2])
    pairs.move()  # every pair, the one that refused included
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []


def test_a_lost_consumer_fails_the_send_instead_of_hanging(pairs_of):
    pairs = pairs_of("prefill=pp2", "decode=tp2", "drafter=none", "transfer.timeout_s=3")
    (p, c), peer = next(iter(pairs.peers.items()))
    pairs.listeners[c].close()
    with pytest.raises(TransferError):
        send(peer, [0], [1])
    with pytest.raises(TransferError, match="broken"):
        send(peer, [0], [1])


def _session(listener: P2PListener, producer_rank: int):
    return next(s for s in listener._sessions if s.producer_rank == producer_rank)


@pytest.mark.parametrize("transfer", ["nccl", pytest.param("mooncake_tcp", marks=transfer_kit.needs_mooncake)])
def test_a_broken_pair_pairs_again_and_the_next_request_lands(graph_of, transports, monkeypatch, transfer):
    """The consumer's end of one pair goes away while its rank lives (its session closed, as
    after a stall past its deadline): the producer's next request fails and breaks the pair,
    a request inside the wait is refused at once, and after it the pair pairs again on the
    next request, which lands exactly, as do every pair's requests after it (over Gloo, and
    through Mooncake staging, where the old session's staging registration is dropped).
    Before, every later request over that pair failed until the producer rank restarted."""
    monkeypatch.setattr(p2p, "REPAIR_WAIT_S", (0.3, 1.0))
    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=none", "transfer.timeout_s=2",
                     f"transfer={transfer}")
    pairs = Pairs(graph, make_transport=transports if transfer != "nccl" else None)
    try:
        (p, c), peer = next(iter(pairs.peers.items()))
        listener = pairs.listeners[c]
        old = _session(listener, p)
        old.conn.close()
        with pytest.raises(TransferError):
            send(peer, [0], [1])
        assert peer.broken
        with pytest.raises(TransferError, match="pairing again in"):
            send(peer, [0], [1])
        time.sleep(0.35)
        pairs.move()  # this pair pairs again on its first request; every pair lands both requests
        assert peer.repairs == 1 and not peer.broken
        assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []
        assert sum(s.producer_rank == p for s in listener._sessions) == 1  # the old session is gone
        if transfer != "nccl":  # its staging's registration went with it; the new one's is there
            assert (old.receiver.host_base is None
                    and _session(listener, p).receiver.host_base in listener.transport._registered)
    finally:
        pairs.close()


def test_a_pair_whose_consumer_is_gone_retries_ever_less_often(pairs_of, monkeypatch):
    """The consumer rank is gone for good: each attempt to pair again fails (and says why),
    and the wait before the next doubles, so the requests in between are refused at once."""
    monkeypatch.setattr(p2p, "REPAIR_WAIT_S", (0.2, 10.0))
    pairs = pairs_of("prefill=pp2", "decode=tp2", "drafter=none", "transfer.timeout_s=2")
    (p, c), peer = next(iter(pairs.peers.items()))
    pairs.listeners[c].close()
    with pytest.raises(TransferError):
        send(peer, [0], [1])
    waits = []
    for _ in range(2):
        time.sleep(peer._repair_at - time.monotonic() + 0.05)
        with pytest.raises(TransferError, match="pairing again failed: consumer rank at .* cannot be reached"):
            send(peer, [0], [1])
        waits.append(peer._repair_wait)
        with pytest.raises(TransferError, match="pairing again in"):
            send(peer, [0], [1])
    assert waits == [0.4, 0.8] and peer.repairs == 0


def test_a_closed_control_connection_is_told_from_a_waiting_message():
    """What lets an NCCL pair's deadline watcher abort as soon as the other end's process
    dies (``GroupDeadline``): an end of stream with nothing before it is a close; a message
    waiting (an error's text) is not, and is left for the reader."""
    import socket

    a, b = socket.socketpair()
    try:
        assert not peer_closed(a)
        b.sendall(b"x")
        assert not peer_closed(a) and a.recv(1) == b"x"  # peeked, not read
        b.sendall(b"y")
        b.close()
        assert not peer_closed(a)  # the message first
        assert a.recv(1) == b"y"
        assert peer_closed(a)
    finally:
        a.close()
    assert peer_closed(a)  # closed here


def test_a_producer_that_stalls_mid_request_is_dropped_and_the_consumer_serves_on(pairs_of):
    """A producer announces a request and sends none of it: the consumer's receive times out
    (Gloo here; on GPUs its NCCL group is aborted at the deadline), it closes that pair, and
    a new pair from the same producer rank lands. Before, the receive's error ended the
    session's thread and left the connection open: the producer saw nothing until its own
    socket timed out."""
    pairs = pairs_of("prefill=pp2", "decode=tp2", "drafter=none", "transfer.timeout_s=2")
    (p, c), peer = next(iter(pairs.peers.items()))
    peer.conn.sock.settimeout(20)  # longer than the consumer's deadline: who closes first shows
    peer.conn.send(P2PRequest(request_id="stalled", dst_blocks=[1], nonce=kv_nonce(KEY, [1])))
    with pytest.raises(PeerClosed):
        peer.conn.recv()
    fresh = P2PPeer(pairing=PAIRING, address=pairs.listeners[c].address, consumer_device="cpu", plan=peer.plan, caches=peer.caches,
                    dst_block_bytes=peer.dst_block_bytes, producer_rank=p, spec=pairs.graph.spec.transfer)
    try:
        landed = pairs.listeners[c].landed
        send(fresh, [0], [1])
        assert pairs.listeners[c].landed == landed + 1
    finally:
        fresh.close()


def test_a_producer_naming_a_rank_without_a_cut_is_refused(graph_of):
    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=none")
    caches = caches_for(graph.rank(CONSUMER, 0).units, NUM_BLOCKS, fill="poison")
    listener = P2PListener(key=KEY, graph=graph, rank=0, caches=caches, spec=graph.spec.transfer)
    try:
        prod = producer_caches_of(graph, NUM_BLOCKS)[0]
        cut = graph.cuts[0]
        with pytest.raises(TransferError, match="no cut plan"):
            P2PPeer(pairing=PAIRING, address=listener.address, consumer_device="cpu", plan=cut.over(set(prod)), caches=prod,
                    dst_block_bytes={u.name: u.bytes_per_block for u in graph.rank(CONSUMER, 0).units},
                    producer_rank=len(graph.producer.ranks) + 5, spec=graph.spec.transfer)
    finally:
        listener.close()


def test_a_consumer_that_cannot_set_up_the_pair_says_why(graph_of):
    """A failure on the consumer's side of pairing (here its receive buffer cannot be
    allocated) reaches the producer as a refusal naming it, not as a closed socket."""
    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=none")
    caches = caches_for(graph.rank(CONSUMER, 0).units, NUM_BLOCKS, fill="poison")
    listener = P2PListener(key=KEY, graph=graph, rank=0, caches=caches, spec=graph.spec.transfer, buffer_bytes=1 << 60)
    try:
        prod = producer_caches_of(graph, NUM_BLOCKS)[0]
        cut = next(c for c in graph.cuts if c.producer_rank == 0 and c.consumer_rank == 0)
        with pytest.raises(TransferError, match="could not set up the pair: .*(Error|alloc)"):
            P2PPeer(pairing=PAIRING, address=listener.address, consumer_device="cpu", plan=cut.over(set(prod)), caches=prod,
                    dst_block_bytes={u.name: u.bytes_per_block for u in graph.rank(CONSUMER, 0).units},
                    producer_rank=0, spec=graph.spec.transfer)
    finally:
        listener.close()


def test_a_set_up_that_fails_after_the_answer_closes_the_connection(graph_of, monkeypatch):
    """An error past the consumer's answer that is not a TransferError (a mapping, a
    buffer, a registration) used to leave the connection open: the consumer's session
    then waited on a producer that had given the pair up. Now the producer's end closes
    it and the consumer's session ends."""
    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=none")
    caches = caches_for(graph.rank(CONSUMER, 0).units, NUM_BLOCKS, fill="poison")
    listener = P2PListener(key=KEY, graph=graph, rank=0, caches=caches, spec=graph.spec.transfer)

    made = GroupSender.set_up

    def broken(self, ready):  # the producer's half only, once its group connected
        made(self, ready)
        raise RuntimeError("a buffer that cannot be split")

    monkeypatch.setattr(GroupSender, "set_up", broken)
    try:
        prod = producer_caches_of(graph, NUM_BLOCKS)[0]
        cut = next(c for c in graph.cuts if c.producer_rank == 0 and c.consumer_rank == 0)
        with pytest.raises(RuntimeError, match="cannot be split") as failed:
            P2PPeer(pairing=PAIRING, address=listener.address, consumer_device="cpu", plan=cut.over(set(prod)),
                    caches=prod, dst_block_bytes={u.name: u.bytes_per_block for u in graph.rank(CONSUMER, 0).units},
                    producer_rank=0, spec=graph.spec.transfer)
        # The error is kept (as a pair that fails to pair again keeps living): its traceback
        # holds the half-made peer, so garbage collection closes nothing; only the peer does.
        deadline = time.monotonic() + 20
        while listener._sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not listener._sessions, "the consumer's session still waits on a pair the producer gave up"
        assert failed.value is not None
    finally:
        listener.close()


def test_a_failed_pair_is_a_named_refusal_and_the_producer_rank_lives_on(graph_of):
    """Through the ranks' KV links: a consumer rank that cannot set a pair up makes the
    producer rank's pairing answer PAIRING_PEER_FAILED with the consumer's reason (the
    engine raises PairingRefused), instead of an exception that ends the producer rank."""
    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=none")
    consumers = {r.rank: KVLink(graph, CONSUMER, r.rank, caches_for(r.units, NUM_BLOCKS, fill="poison"))
                 for r in graph.consumer.ranks}
    consumers[1].listener.buffer_bytes, consumers[1].listener.fit_to_requests = 1 << 60, False
    producer = KVLink(graph, PRODUCER, 0, producer_caches_of(graph, NUM_BLOCKS)[0])
    try:
        with pytest.raises(PairingRefused) as caught:
            producer.pair([link.endpoint() for link in consumers.values()])
        (refusal,) = caught.value.refusals
        assert refusal.code == Code.PAIRING_PEER_FAILED
        assert "could not set up the pair" in refusal.message and refusal.fix
        assert not producer.paired()
        consumers[1].listener.buffer_bytes, consumers[1].listener.fit_to_requests = 0, True
        producer.pair([link.endpoint() for link in consumers.values()])  # pairs once the consumer can
        assert sorted(producer.consumers[""].p2p) == [0, 1]
    finally:
        for link in (producer, *consumers.values()):
            link.close()


def test_a_pair_group_whose_peer_never_joins_is_a_transfer_error(tmp_path):
    """Connecting a pair's group (and its probe) can only fail as a TransferError, which
    pairing turns into a PAIRING_PEER_FAILED refusal; a raw store timeout ended the rank."""
    with pytest.raises(TransferError, match="did not connect"):
        pair_group("gloo", str(tmp_path / "store"), 1, 1.0, torch.zeros(64, dtype=torch.uint8))


def test_pair_buffers_fit_the_longest_request_not_the_staging_size(graph_of):
    """A pair's receive buffer (device memory outside the KV budget on a GPU) is what the
    longest request this consumer serves packs into, not transfer.staging_mib, when that
    is less; never less than that request (which then moves in one buffer)."""
    from pdflow.graph import parallel_of
    from pdflow.transfer.packing import packed_nbytes

    graph = graph_of(*BASE, "prefill=pp2", "decode=tp2", "drafter=dspark")
    caches = caches_for(graph.rank(CONSUMER, 0).units, NUM_BLOCKS, fill="poison")
    staging = graph.spec.transfer.staging_mib << 20
    fitted = P2PListener(key=KEY, graph=graph, rank=0, caches=caches, spec=graph.spec.transfer)
    given = P2PListener(key=KEY, graph=graph, rank=0, caches=caches, spec=graph.spec.transfer, buffer_bytes=staging)
    try:
        par = parallel_of(graph.spec, CONSUMER)
        longest = -(-min(graph.spec.model.max_model_len, graph.budgets[CONSUMER].pool_blocks * par.block_size)
                    // par.block_size)
        for cut in (c for c in graph.cuts if c.consumer_rank == 0):
            plan = cut.over(set(producer_caches_of(graph, NUM_BLOCKS)[cut.producer_rank]))
            size = fitted.pair_buffer_bytes(plan)
            assert packed_nbytes(plan, longest) <= size < staging
            assert given.pair_buffer_bytes(plan) == staging
    finally:
        fitted.close()
        given.close()


@pytest.mark.slow
def test_pd_over_p2p_equals_one_process():
    """PP2 -> TP2 with the DSpark drafter (its context K/V rides the same pairs) over Gloo
    pairs between rank processes gives one process's greedy tokens."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (5, 70, 96)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    small = [*BASE, "drafter=dspark", "prefill.num_kv_blocks=24", "decode.num_kv_blocks=24",
             "prefill.max_num_batched_tokens=64", "decode.max_num_batched_tokens=64", "transfer.staging_mib=1"]

    def tokens(overrides):
        with Deployment(compose([*small, *overrides])) as d:
            outs = d.generate(prompts, greedy)
            assert all(o.error is None for o in outs), [o.error for o in outs]
            assert all(e.num_free_kv_blocks == e.num_kv_blocks for e in (d.producer, d.consumer) if e is not None)
            return [o.token_ids for o in outs], [o.num_drafted for o in outs]

    one, _ = tokens(["prefill=tp1", "decode=tp1", "mode=monolithic"])
    pd, drafted = tokens(["prefill=pp2", "decode=tp2"])
    assert pd == one
    assert sum(drafted) > 0


@pytest.mark.slow
def test_pd_from_an_overlap_scheduled_prefill_equals_one_process():
    """A one-rank prefill with overlap scheduling forced on exports from inside its launched
    step (``worker/overlap_step.py``, no synchronize before the export: the pairs order
    their copies behind the forward); over Gloo pairs into a one-rank decode it gives one
    process's greedy tokens and every block back."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (7, 64, 90)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    small = [*BASE, "drafter=none", "prefill=tp1", "decode=tp1", "prefill.num_kv_blocks=24",
             "decode.num_kv_blocks=24", "prefill.max_num_batched_tokens=64", "decode.max_num_batched_tokens=64",
             "transfer.staging_mib=1"]

    def tokens(overrides, overlapped=False):
        with Deployment(compose([*small, *overrides])) as d:
            assert not overlapped or d.producer.executor.overlap
            outs = d.generate(prompts, greedy)
            assert all(o.error is None for o in outs), [o.error for o in outs]
            assert all(e.num_free_kv_blocks == e.num_kv_blocks for e in (d.producer, d.consumer) if e is not None)
            return [o.token_ids for o in outs]

    assert tokens(["prefill.overlap_scheduling=true"], overlapped=True) == tokens(["mode=monolithic"])
