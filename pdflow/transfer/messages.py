"""Side-channel messages between consumer and producer ranks (msgpack, tagged union).

Pairing, once per (consumer rank, producer rank): the consumer sends ``Hello`` (where its
units live and what they are); the producer checks it against its own plan and answers
``Paired`` (accepted, or refused with the graph's refusal code). Per request: the
consumer sends ``KVWanted`` (its block ids, a nonce, where packed bytes go) to every
producer rank that owes it data; each answers ``KVDone`` once its writes finished or
failed. Decoding is strict: a frame that is not exactly one of these is rejected.

A ``Hello`` carries a random ``pairing`` nonce that every later ``KVWanted`` of that
consumer rank repeats: a producer writes only for wants carrying the nonce of the peer
they name, so a message from anyone who did not pair (a stray process, a stale peer) moves
no byte. It guards against mistakes and strangers on the host, not against someone who can
read the loopback traffic (the channel is not encrypted).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdflow.graph.refusals import Refusal
from pdflow.graph.units import UnitSpec
from pdflow.transfer.descriptors import UnitRegion

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class Area(msgspec.Struct, kw_only=True, frozen=True):
    """A registered staging buffer: ``nbytes`` at address ``base``."""

    base: NonNegative
    nbytes: NonNegative


class Hello(msgspec.Struct, kw_only=True, frozen=True, tag="hello"):
    instance: Name  # the consumer instance (several may pair with one producer)
    rank: NonNegative  # rank within the consumer instance
    session_id: Name  # the rank's transfer engine: host:rpc_port
    reply_to: Name  # the rank's side-channel address, for Paired and KVDone
    units: list[UnitSpec]
    regions: dict[str, UnitRegion]  # by unit name
    probe: Area  # scratch bytes a producer writes at pairing, to open the engine's session
    receive: Area | None = None  # where packed bytes land; None: direct writes only
    pairing: NonNegative = 0  # repeated in every KVWanted of this rank


class Paired(msgspec.Struct, kw_only=True, frozen=True, tag="paired"):
    instance: Name
    consumer_rank: NonNegative
    producer_rank: NonNegative
    refusals: list[Refusal] = []  # empty: accepted

    @property
    def ok(self) -> bool:
        return not self.refusals


class KVWanted(msgspec.Struct, kw_only=True, frozen=True, tag="wanted"):
    request_id: Name
    instance: Name
    consumer_rank: NonNegative
    reply_to: Name  # the consumer rank's side-channel address, for the KVDone
    block_ids: list[NonNegative]
    nonce: NonNegative
    deadline: float  # wall clock (time.time()); no write starts after it
    recv_addr: NonNegative = 0  # packed: where this producer rank's bytes go; 0: direct
    recv_bytes: NonNegative = 0
    pairing: NonNegative = 0  # the consumer rank's Hello.pairing


class KVDone(msgspec.Struct, kw_only=True, frozen=True, tag="done"):
    request_id: Name
    stage: NonNegative
    producer_rank: NonNegative
    consumer_rank: NonNegative
    nonce: NonNegative
    ok: bool
    error: str = ""
    first_token: int | None = None  # sent by the last stage
    logprob: float | None = None


Message = Hello | Paired | KVWanted | KVDone

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Raises ``msgspec.DecodeError`` (or its ``ValidationError``) on anything malformed."""
    return _decoder.decode(frame)
