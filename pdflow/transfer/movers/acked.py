"""The chunk-and-ack loop of the movers that write into the consumer's own receive buffer
(``ipc``: mapped; ``mooncake``: its registered host staging): a chunk at a time, each
scattered and acked before the next is packed into the same buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdflow.transfer.movers.protocol import Receiver, Sender
from pdflow.transfer.p2p_messages import P2PAck, P2PChunk, P2PRequest
from pdflow.transfer.p2p_parts import Phases, size_of, synchronize


class AckedSender(Sender):
    buf: torch.Tensor | None = None  # where chunks are packed: the consumer's buffer, or what reaches it

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int,
             phases: Phases) -> None:
        peer = self.peer
        ids = self.announce(src_blocks, dst_blocks, request_id, nonce, phases)
        parts = peer._chunks(len(src_blocks), self.buffer_bytes, 0)
        for i, chunk in enumerate(parts):
            self.pack(chunk, self.buf, src_blocks, ids)
            synchronize(peer.device)
            phases.mark("pack")
            self.deliver(size_of(chunk), phases)
            peer.conn.send(P2PChunk(index=i, nbytes=size_of(chunk)))
            if i + 1 < len(parts):
                self.ack(i)
                phases.mark("ack")
        self.ack(max(len(parts) - 1, 0))
        phases.mark("ack")
        phases.report()

    def deliver(self, nbytes: int, phases: Phases) -> None:
        """A packed chunk's first ``nbytes`` of ``buf`` into the consumer's buffer (nothing
        to do when ``buf`` is that buffer)."""


class AckedReceiver(Receiver):
    buf: torch.Tensor | None = None  # where chunks are scattered from

    def receive(self, request: P2PRequest, error: str, pending: dict, phases: Phases) -> None:
        session = self.session
        blocks = request.dst_blocks
        parts = session.chunks(len(blocks), self.buf.numel())
        ids = session.block_ids(blocks, error)
        for i, chunk in enumerate(parts):
            note = session.conn.recv()
            if not isinstance(note, P2PChunk) or note.index != i or note.nbytes != size_of(chunk):
                raise ConnectionError(f"expected chunk {i} of {size_of(chunk)} bytes, got {note}")
            self.arrived(note.nbytes)
            error = error or session.scatter(chunk, self.buf, blocks, ids)
            synchronize(session.listener.device)
            if i + 1 < len(parts):
                session.conn.send(P2PAck(index=i, error=error))
                if error:  # the producer stops at this ack: the request ends here, the pair serves on
                    return
        if not error:
            session.listener.landed += 1  # counted before the ack: the producer may look once it returns
        session.conn.send(P2PAck(index=max(len(parts) - 1, 0), error=error))
        phases.mark("acked")
        phases.report()

    def arrived(self, nbytes: int) -> None:
        """A chunk's ``nbytes`` landed in the consumer's buffer: bring them to ``buf``."""
