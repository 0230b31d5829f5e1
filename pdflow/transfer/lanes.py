"""Transfer calls run off the request path, one worker thread per peer, under our deadline.

The engine's calls block: a peer that accepts a connection but never answers the
handshake holds a call ~61 s (not configurable), a stalled peer until
MC_TRANSFER_TIMEOUT. So every call runs as a job on its peer's lane (a stuck peer stalls
only its own queue), and a watchdog fails the job's future at the job's deadline whether
or not the engine has returned. A job that reaches the front of its queue after its
deadline is not started. Lane threads are daemons: a call stuck in the engine never
holds up interpreter exit.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TypeVar

from pdflow.transfer.errors import TransferError

T = TypeVar("T")


def _settle(future: Future, *, result=None, error: BaseException | None = None) -> bool:
    """Set a future's outcome unless the watchdog or the job did first (the future's own
    lock decides; its callbacks run after, outside any lock of ours)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        return True
    except InvalidStateError:
        return False


class _Watchdog:
    """Fails futures still pending at their deadline."""

    def __init__(self):
        self._heap: list[tuple[float, int, Future, str]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._loop, name="pdflow-transfer-watchdog", daemon=True).start()

    def watch(self, deadline: float, future: Future, what: str) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), future, what))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            expired = []
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done() or self._heap[0][0] <= now):
                    expired.append(heapq.heappop(self._heap))
                if not expired:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            for _, _, future, what in expired:  # outside the lock: callbacks may submit jobs
                _settle(future, error=TransferError(f"{what}: no result by its deadline"))


class Lanes:
    """One daemon thread and queue per key (a peer's session id)."""

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._watchdog = _Watchdog()
        self._closed = False

    def submit(self, key: str, job: Callable[[float], T], *, deadline: float, what: str = "transfer") -> Future:
        """Run ``job(deadline)`` on ``key``'s lane; the future holds its result, or a
        ``TransferError`` by ``deadline`` (``time.monotonic()`` seconds) at the latest."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise TransferError("the transport is closed")
            lane = self._queues.get(key)
            if lane is None:
                lane = self._queues[key] = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(lane,), name=f"pdflow-lane-{key}",
                                 daemon=True).start()
        self._watchdog.watch(deadline, future, f"{what} to {key}")
        lane.put((job, deadline, future, what))
        return future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for lane in self._queues.values():
                lane.put(None)
            self._queues.clear()
        self._watchdog.stop()

    @staticmethod
    def _serve(lane: queue.SimpleQueue) -> None:
        while (item := lane.get()) is not None:
            job, deadline, future, what = item
            if future.done():
                continue
            if time.monotonic() >= deadline:
                _settle(future, error=TransferError(f"{what}: deadline passed before it started"))
                continue
            try:
                _settle(future, result=job(deadline))
            except BaseException as err:  # handed to the waiter, never lost in this thread
                _settle(future, error=err)
