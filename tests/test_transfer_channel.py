"""The side channel over real ZMQ sockets on loopback: typed messages round-trip, and
anything malformed is rejected without the endpoint dying."""

from __future__ import annotations

import os
import socket

import msgspec
import pytest
import zmq

from pdflow.transfer.channel import Endpoint
from pdflow.transfer.messages import KVDone, KVWanted, decode, encode

DONE = KVDone(request_id="r1", stage=3, producer_rank=3, consumer_rank=1, nonce=7, ok=True,
              first_token=42, logprob=-0.5)


@pytest.fixture
def pair():
    a, b = Endpoint(), Endpoint()
    yield a, b
    a.close()
    b.close()


def test_a_message_round_trips_between_endpoints(pair):
    a, b = pair
    assert b.address.startswith("tcp://127.0.0.1:")
    a.send(b.address, DONE)
    assert b.recv(5.0) == DONE
    assert b.recv(0.05) is None


def test_malformed_frames_are_rejected_and_the_endpoint_keeps_serving(pair):
    a, b = pair
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(b.address)
    want = KVWanted(request_id="r", instance="d", consumer_rank=0, reply_to="tcp://127.0.0.1:1", block_ids=[1],
                    nonce=1, deadline=0.0)
    bad_frames = [
        [os.urandom(n)] for n in (0, 1, 7, 64, 4096)
    ] + [
        [encode(DONE), encode(DONE)],  # two frames
        [msgspec.msgpack.encode({"type": "done", "request_id": "r"})],  # fields missing
        [msgspec.msgpack.encode({"type": "shutdown"})],  # unknown tag
        [encode(want).replace(b"\x01", b"\xff", 1)],  # a field of the wrong type
        [msgspec.msgpack.encode({**msgspec.to_builtins(DONE), "type": "done", "nonce": -1})],  # out of range
    ]
    for frames in bad_frames:
        raw.send_multipart(frames)
    raw.send(encode(DONE))
    got = [m for m in iter(lambda: b.recv(2.0), None)]
    assert got == [DONE]
    assert b.rejected == len(bad_frames)
    raw.close()
    ctx.term()


def test_raw_tcp_garbage_does_not_break_the_endpoint(pair):
    a, b = pair
    host, port = b.address.removeprefix("tcp://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(os.urandom(2048))
    a.send(b.address, DONE)
    assert b.recv(5.0) == DONE


def test_decode_refuses_what_is_not_a_message():
    with pytest.raises(msgspec.DecodeError):
        decode(b"\x93\x01\x02\x03")
    assert decode(encode(DONE)) == DONE
