"""A producer rank's KV sender: the rank half of the KV connector, off the forward.

The rank hands a step's exports over once the forward that wrote their KV is enqueued
(after the step's PP send), and goes on with the next step; nothing in a forward waits
for a transfer. A thread takes the exports in step order and writes each request into
every consumer rank at once (one lane per consumer rank; on a GPU each lane runs in its
own stream, which first waits on an event recorded after the forward, so its reads order
after the forward's writes while later forwards run). Settled requests are reported as
``KVSent`` (to the owner's pipe, or kept for an in-process owner to take), whenever they
settle: the owner learns of them on a later step, and holds the requests' blocks on this
side until then, so nothing reuses a block the sender still reads.
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
    """One step's exports, and the event after the forward that wrote them (GPU)."""

    exports: list[KVExport]
    ready: torch.cuda.Event | None


class KVSender:
    """Sends exports on a thread of its own; ``report`` gets each step's ``KVSent`` (None:
    they are kept for ``settled``)."""

    def __init__(self, link: KVLink | None, *, role: str, rank: int, device: torch.device,
                 report: Callable[[KVSent], None] | None = None):
        self.link, self.role, self.rank, self.device = link, role, rank, device
        self._report = report
        consumers = link.consumer_ranks if link is not None else []
        self._lanes = ThreadPoolExecutor(max_workers=max(1, len(consumers)), thread_name_prefix="kv-lane")
        self._streams = ({r: torch.cuda.Stream(device) for r in consumers} if device.type == "cuda" else {})
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._settled: list[KVSent] = []
        self._unsettled = 0  # requests handed over, not yet reported
        self._thread = threading.Thread(target=self._run, name=f"kv-sender-{role}-{rank}", daemon=True)
        self._thread.start()

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
        with self._cond:
            self._unsettled += len(exports)
        self._jobs.put(_Job(exports=list(exports), ready=ready))

    def settled(self, wait_s: float = 0.0) -> list[KVSent]:
        """In process: the reports so far, waiting up to ``wait_s`` for one if none is in."""
        with self._cond:
            if not self._settled and wait_s > 0 and self._unsettled:
                self._cond.wait_for(lambda: self._settled, timeout=wait_s)
            out, self._settled = self._settled, []
            return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every export handed over has settled (before pairing again or closing)."""
        with self._cond:
            self._cond.wait_for(lambda: self._unsettled == 0, timeout=timeout_s)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self._lanes.shutdown(wait=True)

    # -- the sender's thread -------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            sent = self._send(job)
            with self._cond:
                self._unsettled -= len(job.exports)
                if self._report is None:
                    self._settled.append(sent)
                self._cond.notify_all()
            if self._report is not None:
                self._report(sent)

    def _send(self, job: _Job) -> KVSent:
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
                inject_fault("export", self.role, self.rank)
                if self.link is None:
                    raise RuntimeError(f"{self.role} rank {self.rank} has no KV link")
                lanes = [self._lanes.submit(self._lane, r, export, job.ready) for r in self.link.consumer_ranks]
                errors = [e for e in (lane.exception() for lane in lanes) if e is not None]
                if errors:
                    raise errors[0]
                nbytes += sum(lane.result() for lane in lanes)
            except Exception as err:  # a failed write fails the request, never the rank
                failed[export.request_id] = f"{type(err).__name__}: {err}"
        return KVSent(rank=self.rank, request_ids=[e.request_id for e in job.exports], failed=failed,
                      nbytes=nbytes)

    @torch.inference_mode()
    def _lane(self, consumer_rank: int, export: KVExport, ready: torch.cuda.Event | None) -> int:
        stream = self._streams.get(consumer_rank)
        if stream is None:
            return self.link.send(consumer_rank, export)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):  # a thread starts on GPU 0
            stream.wait_event(ready)  # the forward that wrote this KV, before any read of it
            return self.link.send(consumer_rank, export)
