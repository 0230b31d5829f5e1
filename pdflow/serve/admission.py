"""Admission in front of the engine: a bounded waiting room sized by the KV pool.

Every request handed to the engine reserves the blocks its prompt needs (plus one for
its first tokens); a request that does not fit waits here, first come first served.
The room is bounded twice, by its length (``max_queued``: beyond it a request is refused
at once) and by time (``queue_timeout_s``: a request that waited that long is refused);
either refusal is a 503 with ``Retry-After``. So an overloaded server answers quickly
instead of growing an unbounded queue behind a full pool. Growth past the reservation
is the engine's business (it preempts), as it is without admission.

Used from the engine-loop thread only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class AdmissionPolicy:
    max_queued: int = 256
    queue_timeout_s: float = 30.0
    # What a refused client is told to wait before trying again.
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_queued < 0 or self.queue_timeout_s <= 0 or self.retry_after_s < 0:
            raise ValueError("admission needs max_queued >= 0, queue_timeout_s > 0, retry_after_s >= 0")


def policy_of(serve) -> AdmissionPolicy:
    """The policy a ``ServeSpec`` asks for (every role that runs an engine uses it)."""
    return AdmissionPolicy(max_queued=serve.max_queued_requests, queue_timeout_s=serve.queue_timeout_s)


@dataclass(kw_only=True, slots=True)
class _Waiting:
    item: object
    need: int
    since: float


class Admission:
    """Tracks reservations against a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, policy: AdmissionPolicy, *, num_blocks: int, block_size: int):
        self.policy, self.num_blocks, self.block_size = policy, num_blocks, block_size
        self.reserved = 0
        self._held: dict[int, int] = {}  # id(item) -> blocks reserved
        self._waiting: deque[_Waiting] = deque()

    def need(self, prompt_len: int) -> int:
        return min(self.num_blocks, math.ceil((prompt_len + 1) / self.block_size))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def offer(self, item: object, prompt_len: int, now: float | None = None) -> bool:
        """Queue ``item``; False when the waiting room is full (refuse it)."""
        if len(self._waiting) >= self.policy.max_queued and not self._fits_now(self.need(prompt_len)):
            return False
        self._waiting.append(_Waiting(item=item, need=self.need(prompt_len),
                                      since=time.monotonic() if now is None else now))
        return True

    def ready(self) -> list:
        """Items that fit now, in arrival order; their blocks are reserved."""
        out = []
        while self._waiting and self.reserved + self._waiting[0].need <= self.num_blocks:
            waiting = self._waiting.popleft()
            self.reserved += waiting.need
            self._held[id(waiting.item)] = waiting.need
            out.append(waiting.item)
        return out

    def expired(self, now: float | None = None) -> list:
        """Items that waited ``queue_timeout_s`` without fitting: they leave the queue."""
        now = time.monotonic() if now is None else now
        late = [w for w in self._waiting if now - w.since >= self.policy.queue_timeout_s]
        for w in late:
            self._waiting.remove(w)
        return [w.item for w in late]

    def withdraw(self, item: object) -> bool:
        """Take a waiting item out (its client went away)."""
        for w in self._waiting:
            if w.item is item:
                self._waiting.remove(w)
                return True
        return False

    def release(self, item: object) -> None:
        self.reserved -= self._held.pop(id(item), 0)

    def drain(self) -> list:
        """Every waiting item, removed (the loop is stopping)."""
        out = [w.item for w in self._waiting]
        self._waiting.clear()
        return out

    def _fits_now(self, need: int) -> bool:
        """It would not wait: it fits behind every request already waiting (arrivals of one
        batch wait here together until the next ``ready``, all of them admitted by it)."""
        return self.reserved + sum(w.need for w in self._waiting) + need <= self.num_blocks
