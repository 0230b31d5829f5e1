"""Transfer calls run off the request path, one daemon thread per peer, under our deadline.

An engine call can block ~61 s (a peer that never answers the handshake) or until
MC_TRANSFER_TIMEOUT, so each runs on its peer's lane (a stuck peer stalls only its own
queue) and its caller gets a ``TransferError`` at the deadline whether or not it returned.
A job not started by its deadline never starts; lane threads are daemons, so a call stuck
in the engine never holds up interpreter exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitTimeout
from typing import TypeVar

from pdflow.transfer.errors import TransferError

T = TypeVar("T")


class Lanes:
    """One daemon thread and queue per key (a peer's session id)."""

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._closed = False

    def run(self, key: str, job: Callable[[float], T], *, deadline: float, what: str = "transfer") -> T:
        """``job(deadline)`` on ``key``'s lane: its result, or a ``TransferError`` by
        ``deadline`` (``time.monotonic()`` seconds) at the latest."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise TransferError("the transport is closed")
            lane = self._queues.get(key)
            if lane is None:
                lane = self._queues[key] = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(lane,), name=f"pdflow-lane-{key}",
                                 daemon=True).start()
        lane.put((job, deadline, future, what))
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except WaitTimeout:
            future.cancel()  # still queued: it never starts (one already running is left to end)
            raise TransferError(f"{what} to {key}: no result by its deadline") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for lane in self._queues.values():
                lane.put(None)
            self._queues.clear()

    @staticmethod
    def _serve(lane: queue.SimpleQueue) -> None:
        while (item := lane.get()) is not None:
            job, deadline, future, what = item
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting before it started
            if time.monotonic() >= deadline:
                future.set_exception(TransferError(f"{what}: deadline passed before it started"))
                continue
            try:
                future.set_result(job(deadline))
            except BaseException as err:  # handed to the waiter, never lost in this thread
                future.set_exception(err)
