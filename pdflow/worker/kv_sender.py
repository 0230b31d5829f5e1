"""A producer rank's KV sender: the rank half of the KV connector, off the forward.

The rank hands a step's exports over once the forward that wrote their KV is enqueued
(after the step's PP send), and goes on with the next step; nothing in a forward waits
for a transfer. The exports are split by the consumer instance they go to, and each
consumer has a queue and a thread of its own (made at its first export), so a consumer
that is slow or dead (a write waits up to ``transfer.timeout_s``) holds back only its own
exports, never another consumer's. A consumer's thread takes its exports in step order and
writes each request into every rank of that consumer at once (one lane per consumer rank;
on a GPU each lane runs in its own stream, which first waits on an event recorded after
the forward, so its reads order after the forward's writes while later forwards run).
Settled requests are reported as ``KVSent``, one per consumer per step (to the owner's
pipe, or kept for an in-process owner to take, who may ask to be told: ``on_settle``),
whenever they settle: the owner learns of them on a later step, keyed by request id, and
holds the requests' blocks on this side until then, so nothing reuses a block the sender
still reads. ``close_consumer`` lets one consumer's exports in flight settle and stops its
thread (before its peers are forgotten or replaced); the others' go on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdflow.parallel.messages import KVExport, KVSent
from pdflow.worker.faults import inject_fault
from pdflow.worker.kv_link import KVLink


@dataclass(kw_only=True, slots=True)
class _Job:
    """One step's exports to one consumer, and the event after the forward that wrote
    them (GPU)."""

    exports: list[KVExport]
    ready: torch.cuda.Event | None


class _ConsumerLanes:
    """One consumer instance's queue, thread, and a lane (and stream, on a GPU) per
    consumer rank: nothing here is shared with another consumer, so nothing waits on one."""

    def __init__(self, sender: KVSender, consumer: str):
        self.consumer = consumer
        ranks = sender.link.consumer_ranks if sender.link is not None else []
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(ranks)), thread_name_prefix=f"kv-lane-{consumer}")
        self.streams = ({r: torch.cuda.Stream(sender.device) for r in ranks}
                        if sender.device.type == "cuda" else {})
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=sender._run, args=(self,), daemon=True,
                                       name=f"kv-sender-{sender.role}-{sender.rank}-{consumer}")
        self.thread.start()

    def close(self) -> None:
        """Let every job queued settle, then stop."""
        self.jobs.put(None)
        self.thread.join()
        self.pool.shutdown(wait=True)


class KVSender:
    """Sends exports on a thread per consumer instance; ``report`` gets each consumer's
    ``KVSent`` per step (None: they are kept for ``settled``)."""

    def __init__(self, link: KVLink | None, *, role: str, rank: int, device: torch.device,
                 report: Callable[[KVSent], None] | None = None, on_settle: Callable[[], None] | None = None):
        self.link, self.role, self.rank, self.device = link, role, rank, device
        self._report = report
        # Called on a consumer's thread after each report: an in-process owner's loop that
        # waits for commands wakes for the settled export instead of finding it on a poll.
        self._on_settle = on_settle
        # Consumer instance id -> its lanes; touched only by the rank's thread (start, close).
        self._consumers: dict[str, _ConsumerLanes] = {}
        self._cond = threading.Condition()
        self._settled: list[KVSent] = []
        self._unsettled = 0  # requests handed over, not yet reported

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._unsettled > 0

    def start(self, exports: list[KVExport]) -> None:
        """Hand a step's exports over, right after its forward is enqueued; returns at once."""
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        by_consumer: dict[str, list[KVExport]] = {}
        for export in exports:
            by_consumer.setdefault(export.consumer, []).append(export)
        with self._cond:
            self._unsettled += len(exports)
        for consumer, mine in by_consumer.items():
            lanes = self._consumers.get(consumer)
            if lanes is None:
                lanes = self._consumers[consumer] = _ConsumerLanes(self, consumer)
            lanes.jobs.put(_Job(exports=mine, ready=ready))

    def settled(self, wait_s: float = 0.0) -> list[KVSent]:
        """In process: the reports so far, waiting up to ``wait_s`` for one if none is in."""
        with self._cond:
            if not self._settled and wait_s > 0 and self._unsettled:
                self._cond.wait_for(lambda: self._settled, timeout=wait_s)
            out, self._settled = self._settled, []
            return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every export handed over, to every consumer, has settled."""
        with self._cond:
            self._cond.wait_for(lambda: self._unsettled == 0, timeout=timeout_s)

    def close_consumer(self, consumer: str) -> None:
        """Let the exports in flight to ``consumer`` settle (reported as usual) and stop its
        thread, before its peers are forgotten or replaced; other consumers' go on. A later
        export to it starts a new thread."""
        lanes = self._consumers.pop(consumer, None)
        if lanes is not None:
            lanes.close()

    def close(self) -> None:
        while self._consumers:
            self.close_consumer(next(iter(self._consumers)))

    # -- a consumer's thread -------------------------------------------------------------

    def _run(self, lanes: _ConsumerLanes) -> None:
        while (job := lanes.jobs.get()) is not None:
            sent = self._send(lanes, job)
            with self._cond:
                self._unsettled -= len(job.exports)
                if self._report is None:
                    self._settled.append(sent)
                self._cond.notify_all()
            if self._report is not None:
                self._report(sent)
            if self._on_settle is not None:
                self._on_settle()

    def _send(self, lanes: _ConsumerLanes, job: _Job) -> KVSent:
        failed: dict[str, str] = {}
        nbytes = 0
        try:
            if job.ready is not None and self.link is not None and self.link.writes_outside_streams:
                job.ready.synchronize()
        except Exception as err:  # the forward itself failed on the device
            failed = dict.fromkeys((e.request_id for e in job.exports), f"{type(err).__name__}: {err}")
        for export in job.exports:
            if export.request_id in failed:
                continue
            try:
                if self.link is None:
                    raise RuntimeError(f"{self.role} rank {self.rank} has no KV link")
                sends = [lanes.pool.submit(self._lane, lanes, r, export, job.ready) for r in self.link.consumer_ranks]
                errors = [e for e in (s.exception() for s in sends) if e is not None]
                if errors:
                    raise errors[0]
                nbytes += sum(s.result() for s in sends)
            except Exception as err:  # a failed write fails the request, never the rank
                failed[export.request_id] = f"{type(err).__name__}: {err}"
        return KVSent(rank=self.rank, request_ids=[e.request_id for e in job.exports], failed=failed,
                      nbytes=nbytes)

    @torch.inference_mode()
    def _lane(self, lanes: _ConsumerLanes, consumer_rank: int, export: KVExport,
              ready: torch.cuda.Event | None) -> int:
        inject_fault("export", self.role, self.rank, consumer=export.consumer)
        stream = lanes.streams.get(consumer_rank)
        if stream is None:
            return self.link.send(consumer_rank, export)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):  # a thread starts on GPU 0
            stream.wait_event(ready)  # the forward that wrote this KV, before any read of it
            return self.link.send(consumer_rank, export)
