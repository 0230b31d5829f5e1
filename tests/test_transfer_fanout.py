"""A producer rank sends one request to all its consumer ranks at once (``Fanout``): the
pairs run together (sent one after another, the test's barrier breaks), every consumer
rank still holds exactly its heads, and a pair that fails fails the request only after the
other pairs finished, leaving them serving."""

from __future__ import annotations

import threading

import pytest
import transfer_kit
from test_transfer_p2p import REQUESTS, pairs_of  # noqa: F401  (the fixture)
from transfer_kit import wrong_units

from pdflow.transfer.errors import TransferError
from pdflow.transfer.fanout import Fanout

one_torch_thread = transfer_kit.one_torch_thread
LAYOUT = ("prefill=pp2", "decode=tp2", "drafter=dspark")


def fanouts(pairs) -> dict[int, Fanout]:
    by_producer: dict[int, dict] = {}
    for (p, c), peer in pairs.peers.items():
        by_producer.setdefault(p, {})[c] = peer
    return {p: Fanout(peers) for p, peers in by_producer.items()}


def meet_before_sending(peers, timeout_s: float = 5.0) -> None:
    """Each pair's send waits until every pair of the fan-out is sending."""
    barrier = threading.Barrier(len(peers), timeout=timeout_s)
    for peer in peers:
        real = peer.send

        def send(*args, _real=real, **kwargs):
            barrier.wait()
            return _real(*args, **kwargs)

        peer.send = send


def test_every_pair_sends_at_once_and_lands_exactly(pairs_of):  # noqa: F811
    pairs = pairs_of(*LAYOUT)
    outs = fanouts(pairs)
    try:
        assert all(len(f.peers) == 2 for f in outs.values())
        for fan in outs.values():
            meet_before_sending(fan.peers.values())
        for src, dst in REQUESTS.values():
            for fan in outs.values():
                fan.send(src, dst)
    finally:
        for fan in outs.values():
            fan.close()
    assert wrong_units(pairs.graph, pairs.producer_caches, pairs.consumer_caches, REQUESTS.values()) == []
    assert sum(lis.landed for lis in pairs.listeners.values()) == len(REQUESTS) * len(pairs.peers)


def test_sent_one_after_another_the_barrier_breaks(pairs_of):  # noqa: F811
    """The check above can fail: the same pairs sent in turn never meet."""
    pairs = pairs_of(*LAYOUT)
    fan = fanouts(pairs)[0]
    meet_before_sending(fan.peers.values(), timeout_s=0.5)
    src, dst = REQUESTS["a"]
    with pytest.raises(threading.BrokenBarrierError):
        for peer in fan.peers.values():
            peer.send(src, dst)
    fan.close()


def test_a_failing_pair_fails_the_request_after_the_others_land(pairs_of):  # noqa: F811
    pairs = pairs_of(*LAYOUT, "transfer.timeout_s=3")
    fan = fanouts(pairs)[0]
    lost, live = sorted(fan.peers)
    pairs.listeners[lost].close()
    src, dst = REQUESTS["a"]
    try:
        with pytest.raises(TransferError):
            fan.send(src, dst)
        assert pairs.listeners[live].landed == 1  # the live pair finished its part
        assert fan.peers[lost].broken and not fan.peers[live].broken
        fan.peers[live].send(*REQUESTS["b"])  # and serves on
        assert pairs.listeners[live].landed == 2
    finally:
        fan.close()
