"""Consumer side, one per rank: where producers write, and when a request's KV is whole.

The importer registers this rank's unit caches and a receive area, publishes both in a
``Hello``, and per request (``expect``) hands out one ``KVWanted`` per producer rank that
owes this rank data (the graph's cut plans say which), each with a nonce and, on the
packed path, a slot of the receive area (a request that finds no room goes direct).
``on_done`` scatters a producer's packed bytes into the caches and completes the request
when every producer rank has reported; a failure, a deadline (``expire``) or ``cancel``
ends it. A done with a stale nonce is ignored. After a failure, a producer that has not
reported may still be writing: its receive slot stays reserved, and the outcome's
``reuse_after`` says when the request's blocks are safe to hand out again.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pdflow.graph.run_graph import RunGraph
from pdflow.transfer import packing
from pdflow.transfer.messages import Hello, KVDone, KVWanted
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.staging import PROBE_BYTES, StagingBuffer
from pdflow.transfer.unit_caches import register_caches


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportOutcome:
    request_id: str
    ok: bool
    block_ids: tuple[int, ...]
    error: str = ""
    first_token: int | None = None
    logprob: float | None = None
    # time.monotonic() after which no producer write into these blocks can still land.
    reuse_after: float = 0.0


@dataclass(kw_only=True, slots=True)
class _Pending:
    request_id: str
    nonce: int
    block_ids: tuple[int, ...]
    deadline: float  # monotonic
    owed: set[int]  # producer ranks that have not reported
    slots: dict[int, int] = field(default_factory=dict)  # producer rank -> receive offset
    first_token: int | None = None
    logprob: float | None = None


class KVImporter:
    def __init__(self, graph: RunGraph, rank: int, caches: Mapping[str, torch.Tensor],
                 transport: MooncakeTransport, *, instance: str, reply_to: str):
        """``caches``: this rank's unit caches by unit name, shaped as ``UnitSpec.cache_shape``;
        ``instance``: this consumer instance's name; ``reply_to``: this rank's side-channel
        address (``Endpoint.address``)."""
        me = graph.rank("decode", rank)
        self.graph, self.rank, self.transport = graph, rank, transport
        self.spec = graph.spec.transfer
        self.instance, self.reply_to = instance, reply_to
        self.cuts = {c.producer_rank: c for c in graph.cuts if c.consumer_rank == rank}
        self.stages = {p: graph.rank("prefill", p).stage for p in self.cuts}
        self.units = me.units
        filled = {dst for cut in self.cuts.values() for g in cut.groups for _, dst in g.units}
        self.caches, self.regions = register_caches(transport, me.units, caches, filled)
        self.num_blocks = next(iter(self.regions.values())).num_blocks
        self._src_bytes = {p: {u.name: u.bytes_per_block for u in graph.rank("prefill", p).units}
                           for p in self.cuts}
        self.probe = StagingBuffer(transport, PROBE_BYTES, "cpu")
        self.receive = None
        if self.spec.staging:
            device = next(iter(self.caches.values())).device
            self.receive = StagingBuffer(transport, self.spec.staging_mib << 20, device)
        self._pending: dict[str, _Pending] = {}
        self._draining: dict[str, _Pending] = {}  # ended, but producers may still write
        self.pairing = secrets.randbits(63)  # producers serve only wants that carry it
        self.stale = 0  # dones ignored: unknown request, old nonce, or not owed

    def hello(self) -> Hello:
        """What producers need to pair with this rank; send it to each of ``self.cuts``."""
        return Hello(instance=self.instance, rank=self.rank, session_id=self.transport.session_id,
                     reply_to=self.reply_to, units=list(self.units), regions=dict(self.regions),
                     probe=self.probe.area, receive=self.receive.area if self.receive else None,
                     pairing=self.pairing)

    def expect(self, request_id: str, block_ids: Sequence[int]) -> dict[int, KVWanted]:
        """Register a request whose KV goes into ``block_ids``; returns the ``KVWanted``
        to send to each producer rank (by rank) that owes this rank data."""
        blocks = tuple(block_ids)
        if request_id in self._pending or request_id in self._draining:
            raise ValueError(f"request {request_id} is in flight already")
        if not blocks or len(set(blocks)) != len(blocks) or not all(0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"block ids {list(blocks)} must be distinct, in [0, {self.num_blocks})")
        pending = _Pending(request_id=request_id, nonce=secrets.randbits(63), block_ids=blocks,
                           deadline=time.monotonic() + self.spec.timeout_s, owed=set(self.cuts))
        wall_deadline = time.time() + self.spec.timeout_s
        wanted = {}
        for producer, cut in self.cuts.items():
            addr = nbytes = 0
            if self.receive is not None:
                nbytes = packing.packed_nbytes(cut, len(blocks))
                offset = self.receive.arena.alloc(nbytes)
                if offset is None:
                    nbytes = 0  # no room: this producer writes direct
                else:
                    pending.slots[producer] = offset
                    addr = self.receive.base + offset
            wanted[producer] = KVWanted(request_id=request_id, instance=self.instance, consumer_rank=self.rank,
                                        reply_to=self.reply_to, block_ids=list(blocks), nonce=pending.nonce, deadline=wall_deadline,
                                        recv_addr=addr, recv_bytes=nbytes, pairing=self.pairing)
        self._pending[request_id] = pending
        return wanted

    def on_done(self, done: KVDone) -> ImportOutcome | None:
        """Take a producer's report; returns the outcome when it ends the request."""
        drained = self._draining.get(done.request_id)
        if drained is not None and drained.nonce == done.nonce and done.producer_rank in drained.owed:
            self._release(drained, done.producer_rank)  # a late report: its slot is free now
            if not drained.owed:
                del self._draining[done.request_id]
            return None
        pending = self._pending.get(done.request_id)
        if (pending is None or done.nonce != pending.nonce or done.consumer_rank != self.rank
                or done.producer_rank not in pending.owed):
            self.stale += 1
            return None
        if not done.ok:
            return self._end(pending, f"producer rank {done.producer_rank} (stage {done.stage}) "
                                      f"failed: {done.error}", reported=done.producer_rank)
        if done.producer_rank in pending.slots:
            cut, offset = self.cuts[done.producer_rank], pending.slots[done.producer_rank]
            packed = self.receive.view(offset, packing.packed_nbytes(cut, len(pending.block_ids)))
            packing.unpack(cut, packed, pending.block_ids, self.caches, self._src_bytes[done.producer_rank])
        self._release(pending, done.producer_rank)
        if done.first_token is not None:
            pending.first_token, pending.logprob = done.first_token, done.logprob
        if pending.owed:
            return None
        del self._pending[done.request_id]
        return ImportOutcome(request_id=pending.request_id, ok=True, block_ids=pending.block_ids,
                             first_token=pending.first_token, logprob=pending.logprob,
                             reuse_after=time.monotonic())

    def expire(self, now: float | None = None) -> list[ImportOutcome]:
        """End every request past its deadline; also frees the slots of ended requests
        whose producers never reported, once no write of theirs can land."""
        now = time.monotonic() if now is None else now
        out = [self._end(p, f"producer ranks {sorted(p.owed)} did not report within {self.spec.timeout_s} s")
               for p in list(self._pending.values()) if p.deadline <= now]
        for request_id, p in list(self._draining.items()):
            if p.deadline + self.spec.timeout_s <= now:
                for producer in list(p.owed):
                    self._release(p, producer)
                del self._draining[request_id]
        return out

    def cancel(self, request_id: str) -> ImportOutcome | None:
        """End a request the engine gave up on (aborted, or its producer is gone)."""
        pending = self._pending.get(request_id)
        return None if pending is None else self._end(pending, "cancelled")

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.probe.close()
        if self.receive is not None:
            self.receive.close()
        for region in self.regions.values():
            self.transport.unregister(region.base)

    def _release(self, pending: _Pending, producer: int) -> None:
        pending.owed.discard(producer)
        offset = pending.slots.pop(producer, None)
        if offset is not None:
            self.receive.arena.free(offset)

    def _end(self, pending: _Pending, error: str, *, reported: int | None = None) -> ImportOutcome:
        del self._pending[pending.request_id]
        if reported is not None:
            self._release(pending, reported)
        silent = bool(pending.owed)
        if silent:
            self._draining[pending.request_id] = pending
        reuse_after = pending.deadline + self.spec.timeout_s if silent else time.monotonic()
        return ImportOutcome(request_id=pending.request_id, ok=False, block_ids=pending.block_ids,
                             error=error, reuse_after=reuse_after)
