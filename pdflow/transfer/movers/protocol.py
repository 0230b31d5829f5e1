"""The mover protocol: how a ``p2p`` pair's bytes move, in two halves: a ``Sender`` on the
producer rank, a ``Receiver`` on the consumer rank. Each mover owns its set-up (what its
``P2PReady`` carries), its per-request send or receive, and its release; the pair's ends
keep the rest (the hello, the token, nonce and block checks, locks, repairs, deadlines)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdflow.transfer.errors import TransferError
from pdflow.transfer.p2p_messages import P2PAck, P2PHello, P2PReady, P2PRequest
from pdflow.transfer.p2p_parts import IN_PROCESS, Phases, copy_chunk
from pdflow.transfer.packing import Piece

if TYPE_CHECKING:  # the pair's ends import the movers, not the other way
    from pdflow.transfer.p2p import P2PPeer
    from pdflow.transfer.p2p_listener import _Session


class Sender:
    """The producer's half of a mover: set up from the consumer's answer, then one
    ``send`` per request (under the pair's lock), then released."""

    direct = False  # writes the consumer's caches itself (no receive buffer): its copies compile for that
    group = None  # the pair's process group, if it has one: the deadline's, aborted on a fault

    def __init__(self, peer: P2PPeer):
        self.peer = peer
        self.buffer_bytes = 0  # the consumer's receive buffer (0: none)

    def set_up(self, ready: P2PReady) -> None:
        raise NotImplementedError

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int,
             phases: Phases) -> None:
        """One request's runs into the consumer's ``dst_blocks``; returns once they are in its caches."""
        raise NotImplementedError

    def release(self) -> None:
        """Let go of what ``set_up`` made (twice is harmless: a pair that fails to pair
        again is released again on the next attempt)."""

    def announce(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int,
                 phases: Phases) -> torch.Tensor | None:
        """The request first (the consumer posts its first receive while this rank packs);
        returns the block ids ``copy_plan`` reads (GPU caches)."""
        peer = self.peer
        peer.conn.send(P2PRequest(request_id=request_id, dst_blocks=list(dst_blocks), nonce=nonce))
        phases.mark("request")
        ids = peer.table.ids(src_blocks) if peer.table is not None else None  # what copy_plan reads
        phases.mark("ids")
        return ids

    def pack(self, chunk: list[Piece], out: torch.Tensor, src_blocks: Sequence[int],
             ids: torch.Tensor | None) -> None:
        peer = self.peer
        copy_chunk(chunk, out, src_blocks, plan=peer.plan, caches=peer.caches, other_block_bytes=peer.dst_block_bytes,
                   reverse=False, table=peer.table, ids=ids, programs=peer.copy_programs)

    def ack(self, index: int) -> None:
        ack = self.peer.conn.recv()
        if not isinstance(ack, P2PAck) or ack.index != index:
            raise ConnectionError(f"expected the ack of chunk {index}, got {ack}")
        if ack.error:
            raise TransferError(f"consumer failed the request: {ack.error}")

    def taken(self, key: str):
        """What the consumer rank of this process handed over under ``key``."""
        value = IN_PROCESS.get(key)
        if value is None:
            raise TransferError(f"consumer rank at {self.peer.address} ended its session before this rank took its "
                                "memory")
        return value


class Receiver:
    """The consumer's half of a mover: set up before the answer (the producer hears why it
    failed), connected after it, then one ``receive`` per request, then released."""

    direct = False  # the producer writes the caches itself: no RunTable here
    group = None  # the pair's process group, if it has one

    def __init__(self, session: _Session):
        self.session = session
        self.in_process = ""  # ipc, peer: its key in the in-process table, when one process holds both ranks

    def set_up(self, hello: P2PHello, buffer_bytes: int) -> P2PReady:
        raise NotImplementedError

    def connect(self, hello: P2PHello, ready: P2PReady) -> None:
        """After the answer went out (a process group's rendezvous)."""

    def post_first(self, blocks: list[int]) -> dict:
        """What must be posted before anything else on a request's path (a pipelined
        pair's first receive); handed to ``receive``."""
        return {}

    def receive(self, request: P2PRequest, error: str, pending: dict, phases: Phases) -> None:
        """One request's bytes into this rank's caches (``error``: why the session refuses
        it already; the mover still keeps the wire in step)."""
        raise NotImplementedError

    def release(self) -> None:
        IN_PROCESS.pop(self.in_process, None)
