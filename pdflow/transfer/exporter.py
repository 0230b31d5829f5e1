"""Producer side, one per rank: writes a request's KV into the consumer ranks it serves.

For every consumer rank the graph gives this rank a cut plan (which runs of which of its
units land where). ``pair`` accepts a consumer rank's ``Hello`` after checking it
against that plan; ``submit`` writes one request's blocks for one consumer rank, packed
(gathered into this rank's send buffer for that peer, a few large writes overlapping the
gather) or direct (one descriptor per run), on the peer's lane and under the request's
deadline.
The result is always a ``KVDone`` to send back: a failure fails that request only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait

import torch

from pdflow.graph.run_graph import RunGraph
from pdflow.transfer import packing
from pdflow.transfer.descriptors import Descriptors, block_descriptors
from pdflow.transfer.errors import TransferError
from pdflow.transfer.messages import Hello, KVDone, KVWanted, Paired
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.pairing import check_hello
from pdflow.transfer.staging import PROBE_BYTES, StagingBuffer
from pdflow.transfer.unit_caches import register_caches

# Bytes per packed write: small enough that gathering the next chunk overlaps the write
# of this one, large enough that the engine's per-call cost is noise.
CHUNK_BYTES = 8 << 20


class KVExporter:
    def __init__(self, graph: RunGraph, rank: int, caches: Mapping[str, torch.Tensor],
                 transport: MooncakeTransport, *, send_buffer_bytes: int | None = None):
        """``caches``: this rank's unit caches by unit name, each shaped as its
        ``UnitSpec.cache_shape``; those the cut plans read are registered here. The
        packed path streams through a send buffer per consumer rank of
        ``send_buffer_bytes`` (default ``transfer.staging_mib``)."""
        me = graph.rank("prefill", rank)
        self.graph, self.rank, self.stage, self.transport = graph, rank, me.stage, transport
        self.spec = graph.spec.transfer
        self.cuts = {c.consumer_rank: c for c in graph.cuts if c.producer_rank == rank}
        self._send_bytes = send_buffer_bytes or self.spec.staging_mib << 20
        need = max((g.bytes_per_unit for c in self.cuts.values() for g in c.groups), default=0)
        if self.spec.staging and min(self._send_bytes // 2, CHUNK_BYTES) < need:
            raise ValueError(f"a send buffer of {self._send_bytes} bytes cannot hold one block's runs of a "
                             f"unit ({need} bytes) in each half; raise transfer.staging_mib")
        sent = {src for cut in self.cuts.values() for g in cut.groups for src, _ in g.units}
        self.caches, self.regions = register_caches(transport, me.units, caches, sent)
        self._peers: dict[tuple[str, int], Hello] = {}
        self._send: dict[tuple[str, int], StagingBuffer] = {}
        self._probe = StagingBuffer(transport, PROBE_BYTES, "cpu")
        self.probes: dict[tuple[str, int], Future] = {}  # pairing probe writes, by peer

    def pair(self, hello: Hello) -> Paired:
        """Check a consumer rank's ``Hello``; the answer goes back to ``hello.reply_to``.
        An accepted peer gets a probe write at once (off this thread), so the engine's
        handshake with it happens now, while it is known to be alive, and not on the path
        of its first request (a handshake that hangs stalls the whole engine)."""
        refusals = check_hello(self.graph, self.rank, hello)
        key = (hello.instance, hello.rank)
        if refusals:
            self._peers.pop(key, None)  # a refused re-pairing forgets the old memory too
            return Paired(instance=hello.instance, consumer_rank=hello.rank, producer_rank=self.rank,
                          refusals=refusals)
        self._peers[key] = hello
        if hello.receive is not None and key not in self._send and hello.rank in self.cuts:
            device = next(iter(self.caches.values())).device
            self._send[key] = StagingBuffer(self.transport, self._send_bytes, device)
        if hello.probe.nbytes:
            probe = Descriptors()
            probe.add(self._probe.base, hello.probe.base, min(PROBE_BYTES, hello.probe.nbytes))
            self.probes[key] = self.transport.run(
                hello.session_id, lambda d: self.transport.write_now(hello.session_id, probe, d),
                deadline=self.transport.deadline(), what="pairing probe")
        return Paired(instance=hello.instance, consumer_rank=hello.rank, producer_rank=self.rank)

    def submit(self, want: KVWanted, producer_blocks: Sequence[int], *, first_token: int | None = None,
               logprob: float | None = None) -> Future:
        """Write ``producer_blocks[i]`` into consumer block ``want.block_ids[i]`` off the
        caller's thread. The future's result is the ``KVDone`` (ok or not) to send to
        ``want.reply_to``, by the deadline (``transfer.timeout_s`` or the request's,
        whichever comes first)."""
        blocks = list(producer_blocks)

        def done(error: str = "") -> KVDone:
            return KVDone(request_id=want.request_id, stage=self.stage, producer_rank=self.rank,
                          consumer_rank=want.consumer_rank, nonce=want.nonce, ok=not error, error=error,
                          first_token=first_token, logprob=logprob)

        outer: Future = Future()
        problem = self._refusal(want, blocks)
        if problem:
            outer.set_result(done(problem))
            return outer
        peer = self._peers[(want.instance, want.consumer_rank)]
        now = time.monotonic()
        deadline = min(now + self.spec.timeout_s, now + (want.deadline - time.time()))
        if want.recv_addr:
            job = lambda d: self._write_packed(want, peer, blocks, d)
        else:
            job = lambda d: self._write_direct(want, peer, blocks, d)
        inner = self.transport.run(peer.session_id, job, deadline=deadline, what=f"request {want.request_id}")

        def settle(f: Future) -> None:
            err = f.exception()
            if err is not None and not isinstance(err, (TransferError, ValueError, IndexError)):
                outer.set_exception(err)  # a bug, not a transfer failure: surface it
            else:
                outer.set_result(done(f"{type(err).__name__}: {err}" if err else ""))

        inner.add_done_callback(settle)
        return outer

    def export(self, want: KVWanted, producer_blocks: Sequence[int], **done_fields) -> KVDone:
        """``submit`` and wait (returns by the deadline)."""
        return self.submit(want, producer_blocks, **done_fields).result()

    def close(self) -> None:
        self._probe.close()
        for buf in self._send.values():
            buf.close()
        for region in self.regions.values():
            self.transport.unregister(region.base)
        self._send.clear()

    def _refusal(self, want: KVWanted, blocks: list[int]) -> str:
        """Why ``want`` cannot be served at all (checked before anything is written)."""
        key = (want.instance, want.consumer_rank)
        if key not in self._peers:
            return f"consumer rank {want.consumer_rank} of {want.instance} has not paired with producer rank {self.rank}"
        peer = self._peers[key]
        if want.pairing != peer.pairing or want.reply_to != peer.reply_to:
            return (f"the request does not come from the paired consumer rank {want.consumer_rank} of "
                    f"{want.instance} (wrong pairing nonce or reply address)")
        cut = self.cuts.get(want.consumer_rank)
        if cut is None:
            return f"producer rank {self.rank} owes consumer rank {want.consumer_rank} nothing"
        if len(blocks) != len(want.block_ids) or not blocks:
            return f"{len(blocks)} producer blocks for {len(want.block_ids)} consumer blocks"
        mine = next(iter(self.regions.values())).num_blocks
        theirs = min(self._peers[key].regions[dst].num_blocks for g in cut.groups for _, dst in g.units)
        if max(blocks) >= mine or max(want.block_ids) >= theirs or min(blocks) < 0:
            return f"block ids outside the caches ({mine} producer, {theirs} consumer blocks)"
        if want.recv_addr:
            area = self._peers[key].receive
            nbytes = packing.packed_nbytes(cut, len(blocks))
            if area is None or want.recv_bytes != nbytes or not (
                    area.base <= want.recv_addr and want.recv_addr + nbytes <= area.base + area.nbytes):
                return f"receive slot {want.recv_addr:#x}+{want.recv_bytes} is not {nbytes} bytes of the receive area"
        return ""

    def _write_direct(self, want: KVWanted, peer: Hello, blocks: list[int], deadline: float) -> None:
        desc = block_descriptors(self.cuts[want.consumer_rank], self.regions, peer.regions, blocks, want.block_ids)
        self.transport.write_now(peer.session_id, desc, deadline)

    def _write_packed(self, want: KVWanted, peer: Hello, blocks: list[int], deadline: float) -> None:
        """Gather the request chunk by chunk into the two halves of the send buffer; each
        chunk's write runs on the peer's data lane while the next chunk is gathered."""
        cut, send = self.cuts[want.consumer_rank], self._send[(want.instance, want.consumer_rank)]
        slot = min(send.tensor.numel() // 2, CHUNK_BYTES)
        writes: list[Future | None] = [None, None]
        try:
            for i, chunk in enumerate(_chunks(packing.pieces(cut, len(blocks), max_bytes=slot), slot)):
                half = i % 2
                if writes[half] is not None:
                    writes[half].result()  # that half is free again
                first = chunk[0].offset
                for piece in chunk:
                    packing.pack_piece(cut, piece, self.caches[piece.src_unit], blocks,
                                       send.view(half * slot + piece.offset - first, piece.nbytes),
                                       dst_block_bytes=peer.regions[piece.dst_unit].block_bytes)
                desc = Descriptors()
                desc.add(send.base + half * slot, want.recv_addr + first, chunk[-1].offset + chunk[-1].nbytes - first)
                writes[half] = self.transport.run(
                    f"{peer.session_id}#data", lambda d, desc=desc: self.transport.write_now(peer.session_id, desc, d),
                    deadline=deadline, what=f"request {want.request_id} chunk {i}")
            for write in writes:
                if write is not None:
                    write.result()
        finally:  # never return while a write may still read the buffer
            for write in writes:
                if write is not None and not write.done():
                    wait([write])


def _chunks(pieces: list[packing.Piece], limit: int) -> list[list[packing.Piece]]:
    """Consecutive pieces grouped into chunks of at most ``limit`` bytes."""
    out: list[list[packing.Piece]] = []
    for piece in pieces:
        if out and piece.offset + piece.nbytes - out[-1][0].offset <= limit:
            out[-1].append(piece)
        else:
            out.append([piece])
    return out
