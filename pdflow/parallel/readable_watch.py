"""Wake an owner when a rank's pipe has something to read, without reading it.

Why: a served prefill instance whose ranks are processes of their own learns that an
export settled from a ``KVSent`` on a rank's pipe, which only its engine loop reads. The
loop, idle between commands, would find it on its next poll; this watch calls the loop's
wake instead. It is edge-triggered by hand: after one call it stays quiet until the owner
re-arms it (having read what was there), so a message the owner leaves unread never makes
it spin, and a missed arm only costs the owner's poll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import wait

CHECK_CLOSED_S = 0.5  # how often a waiting watch looks whether it was closed


class ReadableWatch:
    """Calls ``callback`` (from its own thread; the owner may replace it) once one of
    ``handles()`` (objects ``multiprocessing.connection.wait`` takes) is readable while
    armed, then disarms."""

    def __init__(self, handles: Callable[[], list], callback: Callable[[], None]):
        self._handles, self.callback = handles, callback
        self._armed = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pdflow-readable-watch", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def close(self) -> None:
        self._closed = True
        self._armed.set()  # a disarmed watch waits here
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self._armed.wait()
            if self._closed:
                return
            try:
                ready = wait(self._handles(), timeout=CHECK_CLOSED_S)
            except (OSError, ValueError):  # a handle closed under it: the owner is shutting down
                return
            if ready and self._armed.is_set() and not self._closed:
                self._armed.clear()
                self.callback()
