"""One thread owns the backend and steps it; HTTP handlers talk to it through an inbox.

Engines are not thread-safe and a step blocks for the length of a forward pass, so the
asyncio server never calls the backend itself: it posts ``Submit``/``Abort`` commands and
receives ``StreamEvent``s on a per-request asyncio queue (``call_soon_threadsafe``).
Requests reach the backend through ``Admission`` (a bounded waiting room sized by the KV
pool), so an overloaded server refuses with 503 + Retry-After instead of queueing forever.
The state it steps is a ``ServingCore``, which the engine-core process drives the same way
from its busy loop (``core_process``); this thread is the in-process form of that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from typing import TYPE_CHECKING

from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.admission import Admission, AdmissionPolicy
from pdflow.serve.backend import ServingBackend
from pdflow.serve.serving_core import ServingCore, StreamEvent, Ticket

if TYPE_CHECKING:
    from pdflow.serve.pd_wire import PDRoute

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


class EngineLoop:
    """Steps ``backend`` on a daemon thread until ``stop``. ``on_token(ticket, now)`` and
    ``on_finish(ticket, event)`` let metrics observe latencies where they happen."""

    def __init__(self, backend: ServingBackend, *, on_token=None, on_finish=None, on_step=None,
                 admission: AdmissionPolicy | None = None):
        self.core = ServingCore(backend, on_token=on_token, on_finish=on_finish, on_step=on_step, admission=admission)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pdflow-engine-loop", daemon=True)
        self.error: str | None = None

    @property
    def backend(self) -> ServingBackend:
        return self.core.backend

    @property
    def admission(self) -> Admission:
        return self.core.admission

    # -- called from any thread ------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self.core.backend.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_active(self) -> int:
        return len(self.core.active)

    def submit(self, ticket: Ticket) -> None:
        self._inbox.put(("submit", ticket))
        self.core.backend.wake()  # a step waiting on the backend's own work would hold it back
        if not self._thread.is_alive() and (self.error is not None or self._stop.is_set()):
            self._fail_inbox()  # nobody will take it: answer now rather than never

    def abort(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self._inbox.put(("abort", ticket))
        self.core.backend.wake()

    def open_stream(
        self, prompt_token_ids: list[int], sampling: SamplingParams, *,
        into: asyncio.Queue | None = None, tag: int = 0, route: PDRoute | None = None,
    ) -> tuple[Ticket, asyncio.Queue]:
        """Submit from a coroutine; events arrive on the returned queue (``into``: as
        ``(tag, event)`` on that queue, shared by a request's choices). ``route``: the
        ticket's, for the backend (a separate P/D instance's request)."""
        aio = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue() if into is None else into

        def deliver(event: StreamEvent) -> None:
            item = event if into is None else (tag, event)
            # RuntimeError: the server's event loop has closed, so nobody is listening.
            with contextlib.suppress(RuntimeError):
                aio.call_soon_threadsafe(events.put_nowait, item)

        ticket = Ticket(prompt_token_ids=prompt_token_ids, sampling=sampling, deliver=deliver, route=route)
        self.submit(ticket)
        return ticket, events

    # -- the loop thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.active)
                if self._stop.is_set():
                    break
                self.core.turn()
        except Exception as exc:  # a dead engine must fail its requests, not hang them
            log.exception("engine loop failed")
            self.error = f"{type(exc).__name__}: {exc}"
            for ticket in list(self.core.active.values()):
                self.core.finish(ticket, StreamEvent(error=f"engine failed: {self.error}"))
        finally:
            self.core.fail_all("server is shutting down", 503)
            self._fail_inbox()

    def _drain(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            kind, ticket = command
            if kind == "submit":
                self.core.offer(ticket)
            else:
                self.core.cancel(ticket)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[0] == "submit":
                reason = f"engine failed: {self.error}" if self.error else "server is shutting down"
                command[1].deliver(StreamEvent(error=reason, error_status=503))
