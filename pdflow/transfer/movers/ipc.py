"""``ipc``: one GPU shared by both ranks (NCCL refuses two ranks on one device). The
consumer's receive buffer is mapped into the producer through CUDA IPC (or, both ranks in
one process, handed over as it is: ``p2p_parts.IN_PROCESS``); each chunk is packed
straight into it and acked (``acked``)."""

from __future__ import annotations

import os

import torch

from pdflow.transfer.movers.acked import AckedReceiver, AckedSender
from pdflow.transfer.p2p_messages import P2PHello, P2PReady
from pdflow.transfer.p2p_parts import map_ipc, share_in_process, share_ipc


class IpcSender(AckedSender):
    def set_up(self, ready: P2PReady) -> None:
        self.buffer_bytes = ready.buffer_bytes
        self.buf = self.taken(ready.in_process) if ready.in_process else map_ipc(ready.ipc, self.peer.device)

    def release(self) -> None:
        self.buf = None


class IpcReceiver(AckedReceiver):
    def set_up(self, hello: P2PHello, buffer_bytes: int) -> P2PReady:
        self.buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=self.session.listener.device)
        if hello.pid == os.getpid():  # one process: the buffer itself
            self.in_process = share_in_process(self.buf)
            return P2PReady(buffer_bytes=buffer_bytes, in_process=self.in_process)
        return P2PReady(buffer_bytes=buffer_bytes, ipc=share_ipc(self.buf.untyped_storage()))
