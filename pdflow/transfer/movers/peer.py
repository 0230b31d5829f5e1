"""``peer`` (``transfer.peer_writes``, GPUs of one host that can reach each other's
memory, or one GPU): the consumer's caches are mapped into the producer through CUDA IPC
(or handed over in-process) and one ``copy_runs`` launch per request writes every cut run
from the producer's caches into them (NVLink between two GPUs): no receive buffer, no
pack, no scatter, no ack; the producer checks the block ids before it writes."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pdflow.transfer.errors import TransferError
from pdflow.transfer.movers.protocol import Receiver, Sender
from pdflow.transfer.p2p_messages import CacheMapping, P2PChunk, P2PHello, P2PReady, P2PRequest
from pdflow.transfer.p2p_parts import (
    Phases,
    bad_blocks,
    local_device,
    map_ipc,
    pool_blocks,
    share_in_process,
    share_ipc,
    synchronize,
)
from pdflow.transfer.packing import packed_nbytes
from pdflow.transfer.run_table import RunTable, direct_rows


def enable_peer_access(mine: torch.device, theirs: torch.device) -> None:
    """Let kernels on ``mine`` write ``theirs``'s memory: torch enables peer access the
    first time it copies between two devices, both ways here."""
    if mine != theirs:
        a = torch.zeros(1, device=mine)
        b = torch.zeros(1, device=theirs)
        b.copy_(a)
        a.copy_(b)
        torch.cuda.synchronize(mine)


def share_cache(cache: torch.Tensor) -> CacheMapping:
    return CacheMapping(storage=share_ipc(cache.untyped_storage()), byte_offset=cache.storage_offset() * cache.element_size(), num_blocks=cache.shape[0],
                        nbytes=cache.numel() * cache.element_size())


def map_cache(m: CacheMapping, device: torch.device, mapped: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """A consumer's cache as bytes [blocks, block bytes] in this process (each storage
    mapped once: ``mapped`` keeps them, and keeps them alive). Storages carved from one
    allocation share its handle and differ in offset: the key is both."""
    key = (m.storage.handle, m.storage.offset, m.storage.size)
    if key not in mapped:
        mapped[key] = map_ipc(m.storage, device)
    raw = mapped[key][m.byte_offset:m.byte_offset + m.nbytes]
    return raw.view(m.num_blocks, -1)


def as_bytes_by_block(cache: torch.Tensor) -> torch.Tensor:
    """A cache as bytes [blocks, block bytes], as ``map_cache`` gives a mapped one."""
    return cache.view(-1).view(torch.uint8).view(cache.shape[0], -1)


class PeerSender(Sender):
    """The consumer's caches, mapped here; written by one kernel per request."""

    direct = True
    dst_table: RunTable | None = None

    def set_up(self, ready: P2PReady) -> None:
        peer = self.peer
        self.buffer_bytes = ready.buffer_bytes
        enable_peer_access(peer.device, local_device(peer.consumer_device))
        self._mapped: dict[tuple, torch.Tensor] = {}
        # Opened in this GPU's context (CUDA IPC then maps the memory for this device's
        # kernels, over NVLink when it lives on another GPU).
        self.dst_caches = (self.taken(ready.in_process) if ready.in_process else
                           {n: map_cache(m, peer.device, self._mapped) for n, m in ready.caches.items()})
        self.dst_table = RunTable(peer.plan, self.dst_caches, "dst", device=peer.device)
        self.dst_pool = pool_blocks(peer.plan, self.dst_caches)

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int,
             phases: Phases) -> None:
        """Every run from this rank's caches into the consumer's, one launch."""
        peer = self.peer
        error = bad_blocks(dst_blocks, self.dst_pool)
        if error:  # checked here: a wild address would fault this GPU's context, or theirs
            raise TransferError(error)
        peer.conn.send(P2PRequest(request_id=request_id, dst_blocks=list(dst_blocks), nonce=nonce))
        rows = direct_rows(peer.table, src_blocks, self.dst_table, dst_blocks)
        phases.mark("rows")
        from pdflow.kernels.copy_runs import copy_runs  # GPU path only: loads Triton

        copy_runs(rows, peer.table.max_words, programs=peer.copy_programs)
        synchronize(peer.device)  # in their caches once this returns: one-sided, no ack to wait for
        phases.mark("write")
        peer.conn.send(P2PChunk(index=0, nbytes=packed_nbytes(peer.plan, len(src_blocks))))
        phases.report()

    def release(self) -> None:
        self.dst_caches, self._mapped, self.dst_table = {}, {}, None


class PeerReceiver(Receiver):
    """The producer writes the caches themselves: no buffer; its note says when."""

    direct = True

    def set_up(self, hello: P2PHello, buffer_bytes: int) -> P2PReady:
        lis = self.session.listener
        dst = sorted({d for g in self.session.plan.groups for _, d in g.units})
        if hello.pid == os.getpid():  # one process: the caches themselves
            self.in_process = share_in_process({n: as_bytes_by_block(lis.caches[n]) for n in dst})
            return P2PReady(in_process=self.in_process)
        return P2PReady(caches={n: share_cache(lis.caches[n]) for n in dst})

    def receive(self, request: P2PRequest, error: str, pending: dict, phases: Phases) -> None:
        note = self.session.conn.recv()
        if not isinstance(note, P2PChunk) or note.index != 0:
            raise ConnectionError(f"expected the request's only chunk, got {note}")
        if error:  # one-sided, checked there: this rank only learns of it now
            raise ConnectionError(f"a producer wrote blocks this rank refuses: {error}")
        self.session.listener.landed += 1
