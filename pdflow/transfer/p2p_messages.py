"""Control messages of the two-sided KV pairs (``p2p``), and their framing: one TCP
connection per (producer rank, consumer rank), frames of a 4-byte big-endian length and
a msgpack-encoded tagged message, decoded strictly (anything else ends the connection).
Payload bytes never ride this socket: they are the movers'.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
MAX_FRAME = 1 << 24  # control messages only (a request's block list is the largest)


class P2PHello(msgspec.Struct, kw_only=True, frozen=True, tag="p2p_hello"):
    """Producer -> consumer: who it is, the source units it sends, how bytes will move."""

    producer_rank: NonNegative
    units: list[str]
    mover: str
    pairing: str = ""  # the consumer's pairing token (``grants``), learned from its endpoint
    pid: NonNegative = 0  # the producer's process (CUDA IPC maps only another process's memory)


class CudaIpcHandle(msgspec.Struct, kw_only=True, frozen=True):
    """What ``UntypedStorage._share_cuda_`` returns, typed, to map a buffer in another process."""

    device: NonNegative
    handle: bytes
    size: NonNegative
    offset: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes
    event_sync_required: bool


class CacheMapping(msgspec.Struct, kw_only=True, frozen=True):
    """One consumer cache to map (``peer``): its storage's handle, where the cache starts in
    that storage, and its size in blocks and bytes."""

    storage: CudaIpcHandle
    byte_offset: NonNegative
    num_blocks: NonNegative
    nbytes: NonNegative


class P2PReady(msgspec.Struct, kw_only=True, frozen=True, tag="p2p_ready"):
    """Consumer -> producer: pairing accepted (or ``refused``), the receive buffer's size,
    and what the mover needs to reach it (a group's rendezvous file, a buffer or caches to
    map, or a registered address in the consumer's Mooncake engine)."""

    buffer_bytes: NonNegative = 0
    store_path: str = ""
    ipc: CudaIpcHandle | None = None
    caches: dict[str, CacheMapping] = {}
    session: str = ""  # mooncake: the consumer's transfer engine and its registered buffer
    base: NonNegative = 0
    # ipc, peer with both ranks in one process: the buffer or caches themselves, under this
    # key of ``p2p_parts``' in-process table (CUDA IPC cannot open its own process's memory).
    in_process: str = ""
    refused: str = ""


class P2PRequest(msgspec.Struct, kw_only=True, frozen=True, tag="p2p_request"):
    """Producer -> consumer: one request's KV follows, for these consumer blocks."""

    request_id: str
    dst_blocks: list[NonNegative]
    nonce: NonNegative  # the consumer owner's grant of ``dst_blocks`` (``grants.kv_nonce``)


class P2PChunk(msgspec.Struct, kw_only=True, frozen=True, tag="p2p_chunk"):
    """Producer -> consumer: chunk ``index`` of the request (``nbytes`` of packed runs) is on
    its way (gloo, nccl), already in the shared buffer (ipc), or the whole request is
    already in the caches (peer: one-sided, nothing is acked)."""

    index: NonNegative
    nbytes: NonNegative


class P2PAck(msgspec.Struct, kw_only=True, frozen=True, tag="p2p_ack"):
    """Consumer -> producer: the chunk is scattered into the caches (or why not)."""

    index: NonNegative
    error: str = ""


P2PMessage = P2PHello | P2PReady | P2PRequest | P2PChunk | P2PAck
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(P2PMessage)


class PeerClosed(ConnectionError):
    """The other end closed the connection: how a pair ends when its producer closes it."""


class FramedSocket:
    """Length-prefixed typed messages over one stream socket."""

    def __init__(self, sock: socket.socket):
        # Small request/ack messages: without NODELAY, Nagle holds a message back until the
        # previous one is acknowledged, and the peer's delayed ack costs ~40 ms a request.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, message: P2PMessage) -> None:
        data = _encoder.encode(message)
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def recv(self) -> P2PMessage:
        (n,) = struct.unpack(">I", self._exact(4))
        if n > MAX_FRAME:
            raise ConnectionError(f"a {n}-byte frame is over the {MAX_FRAME}-byte limit")
        return _decoder.decode(self._exact(n))

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise PeerClosed("peer closed the connection")
            got += k
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
