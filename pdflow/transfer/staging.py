"""Registered staging memory for the packed path, and its allocation.

A consumer rank owns one receive area: each (request, producer rank) with packed data
gets a slot in it until its bytes are scattered into the caches. A producer rank owns a
send buffer per consumer rank it writes to, reused piece by piece. Both are registered
once with the transfer engine (each under 2 GiB, so one registration).
"""

from __future__ import annotations

import bisect
import threading

import torch

from pdflow.transfer.messages import Area

ALIGN = 256  # slot alignment in bytes
PROBE_BYTES = 256  # the scratch a pairing probe writes


class Arena:
    """First-fit allocation of aligned byte ranges in ``[0, nbytes)``; thread-safe."""

    def __init__(self, nbytes: int, *, align: int = ALIGN):
        self.nbytes, self.align = nbytes, align
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted, disjoint (start, stop)
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a fresh range of ``nbytes``, or None when none fits."""
        size = -(-max(nbytes, 1) // self.align) * self.align
        with self._lock:
            for i, (start, stop) in enumerate(self._free):
                if stop - start >= size:
                    self._free[i:i + 1] = [(start + size, stop)] if stop - start > size else []
                    self._taken[start] = size
                    return start
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._taken.pop(offset)
            i = bisect.bisect(self._free, (offset, offset + size))
            self._free.insert(i, (offset, offset + size))
            # Merge with the neighbours it touches.
            if i + 1 < len(self._free) and self._free[i][1] == self._free[i + 1][0]:
                self._free[i:i + 2] = [(self._free[i][0], self._free[i + 1][1])]
            if i > 0 and self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1:i + 1] = [(self._free[i - 1][0], self._free[i][1])]

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._taken.values())


class StagingBuffer:
    """``nbytes`` of registered memory with an arena over it."""

    def __init__(self, transport, nbytes: int, device: torch.device | str = "cpu"):
        self.transport = transport
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.base = transport.register(self.tensor)
        self.arena = Arena(nbytes)

    @property
    def area(self) -> Area:
        return Area(base=self.base, nbytes=self.tensor.numel())

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset:offset + nbytes]

    def close(self) -> None:
        self.transport.unregister(self.base)
