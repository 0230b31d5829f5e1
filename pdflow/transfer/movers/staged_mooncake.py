"""``mooncake``: one Mooncake write per chunk into the consumer's registered host staging
(GPU caches pack on the device and go through pinned host memory both ways); any host.
Each chunk is acked (``acked``)."""

from __future__ import annotations

import contextlib

import torch

from pdflow.transfer.descriptors import Descriptors
from pdflow.transfer.errors import TransferError
from pdflow.transfer.movers.acked import AckedReceiver, AckedSender
from pdflow.transfer.p2p_messages import P2PHello, P2PReady
from pdflow.transfer.p2p_parts import Phases


def mooncake_staging(nbytes: int, device: torch.device, transport) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Either end of a Mooncake pair: its host staging (pinned when the caches are on a
    GPU), where ``transport`` registered it, and the buffer chunks are packed into or
    scattered from (the staging itself on CPU; on a GPU a device buffer, copied through it)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = host if device.type != "cuda" else torch.empty(nbytes, dtype=torch.uint8, device=device)
    return host, transport.register(host), buf  # registered last: a failed allocation leaves nothing to undo


class MooncakeSender(AckedSender):
    """Pack (on the GPU), to host, one write into the consumer's staging."""

    host: torch.Tensor | None = None
    host_base: int | None = None  # this side's registered host staging
    remote: tuple[str, int] = ("", 0)  # the consumer's engine and its staging's address there

    def set_up(self, ready: P2PReady) -> None:
        self.buffer_bytes = ready.buffer_bytes
        self.host, self.host_base, self.buf = mooncake_staging(self.buffer_bytes, self.peer.device, self.peer.transport)
        self.remote = (ready.session, ready.base)

    def deliver(self, nbytes: int, phases: Phases) -> None:
        if self.buf is not self.host:
            self.host[:nbytes].copy_(self.buf[:nbytes])  # device to host, synchronous
        session, base = self.remote
        try:
            self.peer.transport.write(session, Descriptors(src=[self.host_base], dst=[base], length=[nbytes]))
        except TransferError as err:  # the consumer waits for this chunk's note: the pair's protocol is lost
            raise ConnectionError(f"the Mooncake write into the consumer's staging failed: {err}") from err
        phases.mark("write")

    def release(self) -> None:
        if self.host_base is not None:
            self.peer.transport.unregister(self.host_base)
            self.host_base = None
        self.buf = None


class MooncakeReceiver(AckedReceiver):
    """Bytes land in host staging; scattered from there (or, GPU caches, its device copy)."""

    host: torch.Tensor | None = None  # the registered host staging
    host_base: int | None = None  # and where the listener's engine registered it

    def set_up(self, hello: P2PHello, buffer_bytes: int) -> P2PReady:
        lis = self.session.listener
        self.host, self.host_base, self.buf = mooncake_staging(buffer_bytes, lis.device, lis.transport)
        return P2PReady(buffer_bytes=buffer_bytes, session=lis.transport.session_id, base=self.host_base)

    def arrived(self, nbytes: int) -> None:
        if self.host is not self.buf:
            self.buf[:nbytes].copy_(self.host[:nbytes], non_blocking=True)  # host to device

    def release(self) -> None:
        super().release()
        if self.host_base is not None:  # its staging, registered for this session only
            with contextlib.suppress(Exception):  # the engine may be closed already (shutdown)
                self.session.listener.transport.unregister(self.host_base)
            self.host_base = None
