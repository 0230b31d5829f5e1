"""One thread owns the backend and steps it; HTTP handlers talk to it through an inbox.

Engines are not thread-safe and a step blocks for the length of a forward pass, so the
asyncio server never calls the backend itself: it posts ``Submit``/``Abort`` commands and
receives ``StreamEvent``s on a per-request asyncio queue (``call_soon_threadsafe``).
Requests reach the backend through ``Admission`` (a bounded waiting room sized by the KV
pool), so an overloaded server refuses with 503 + Retry-After instead of queueing forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.admission import Admission, AdmissionPolicy
from pdflow.serve.backend import DraftStats, ServingBackend

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


@dataclass(kw_only=True, slots=True)
class StreamEvent:
    """Tokens for one request since the previous event, or its end (``finish_reason``),
    or a failure (``error``; ``error_status`` 400 for a refused prompt, 503 for an
    overloaded server (with ``retry_after_s``), 500 otherwise)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    draft: DraftStats | None = None
    error: str | None = None
    error_status: int = 500
    retry_after_s: int | None = None
    # Per token: its logprob, and its top logprobs when the request asked. A request's
    # first event also carries its prompt logprobs (when asked) and its prompt tokens
    # served from the prefix cache (TokenOutput's fields, copied).
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(kw_only=True, slots=True)
class Ticket:
    """One request as the loop tracks it; ``request_id`` is set once the backend took it."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    deliver: Callable[[StreamEvent], None]
    arrival: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    last_token_at: float | None = None
    cancelled: bool = False


class EngineLoop:
    """Steps ``backend`` on a daemon thread until ``stop``. ``on_token(ticket, now)`` and
    ``on_finish(ticket, event)`` let metrics observe latencies where they happen."""

    def __init__(self, backend: ServingBackend, *, on_token=None, on_finish=None,
                 admission: AdmissionPolicy | None = None):
        self.backend = backend
        self.admission = Admission(admission or AdmissionPolicy(), num_blocks=backend.num_kv_blocks,
                                   block_size=backend.block_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, Ticket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pdflow-engine-loop", daemon=True)
        self._on_token = on_token or (lambda ticket, now: None)
        self._on_finish = on_finish or (lambda ticket, event: None)
        self.error: str | None = None

    # -- called from any thread ------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def submit(self, ticket: Ticket) -> None:
        self._inbox.put(("submit", ticket))
        if not self._thread.is_alive() and (self.error is not None or self._stop.is_set()):
            self._fail_inbox()  # nobody will take it: answer now rather than never

    def abort(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self._inbox.put(("abort", ticket))

    def open_stream(
        self, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> tuple[Ticket, asyncio.Queue]:
        """Submit from a coroutine; events arrive on the returned queue."""
        aio = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: StreamEvent) -> None:
            # RuntimeError: the server's event loop has closed, so nobody is listening.
            with contextlib.suppress(RuntimeError):
                aio.call_soon_threadsafe(events.put_nowait, event)

        ticket = Ticket(prompt_token_ids=prompt_token_ids, sampling=sampling, deliver=deliver)
        self.submit(ticket)
        return ticket, events

    # -- the loop thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self._active)
                if self._stop.is_set():
                    break
                self._admit_waiting()
                if self._active:
                    self._deliver(self.backend.step())
        except Exception as exc:  # a dead engine must fail its requests, not hang them
            log.exception("engine loop failed")
            self.error = f"{type(exc).__name__}: {exc}"
            for ticket in list(self._active.values()):
                self._finish(ticket, StreamEvent(error=f"engine failed: {self.error}"))
        finally:
            for ticket in [*self._active.values(), *self.admission.drain()]:
                self._finish(ticket, StreamEvent(error="server is shutting down", error_status=503))
            self._fail_inbox()

    def _drain(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            kind, ticket = command
            if kind == "submit":
                self._offer(ticket)
            elif ticket.request_id in self._active:
                self.backend.abort(ticket.request_id)
                self._finish(ticket, StreamEvent(finish_reason="abort"))
            elif self.admission.withdraw(ticket):
                self._on_finish(ticket, StreamEvent(finish_reason="abort"))
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _offer(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self._on_finish(ticket, StreamEvent(finish_reason="abort"))
        elif not self.admission.offer(ticket, len(ticket.prompt_token_ids)):
            self._refuse(ticket, f"the server is at capacity ({self.admission.num_waiting} requests waiting "
                                 "for KV blocks); retry later")

    def _admit_waiting(self) -> None:
        for ticket in self.admission.expired():
            self._refuse(ticket, f"no KV blocks came free within {self.admission.policy.queue_timeout_s:g} s; "
                                 "retry later")
        for ticket in self.admission.ready():
            self._admit(ticket)

    def _refuse(self, ticket: Ticket, why: str) -> None:
        event = StreamEvent(error=why, error_status=503, retry_after_s=self.admission.policy.retry_after_s)
        self._on_finish(ticket, event)
        ticket.deliver(event)

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self.admission.release(ticket)
            self._on_finish(ticket, StreamEvent(finish_reason="abort"))
            return
        try:
            ticket.request_id = self.backend.add(ticket.prompt_token_ids, ticket.sampling)
        except ValueError as exc:
            self.admission.release(ticket)
            event = StreamEvent(error=str(exc), error_status=400)
            self._on_finish(ticket, event)
            ticket.deliver(event)
            return
        self._active[ticket.request_id] = ticket

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            ticket = self._active.get(out.request_id)
            if ticket is None:  # aborted after the step produced it
                if out.finished:
                    self.backend.draft_stats(out.request_id)  # drop its counts
                continue
            if out.error is not None:  # a fault ended it (a lost instance, a failed KV transfer)
                self._finish(ticket, StreamEvent(error=out.error, error_status=502))
                continue
            self._on_token(ticket, now)
            ticket.last_token_at = now
            event = StreamEvent(token_ids=[out.token_id], text=out.text, logprobs=[out.logprob],
                                top_logprobs=None if out.top_logprobs is None else [out.top_logprobs],
                                prompt_logprobs=out.prompt_logprobs, prompt_top_logprobs=out.prompt_top_logprobs,
                                num_cached_tokens=out.num_cached_tokens)
            if out.finished:
                event.finish_reason = out.finish_reason or "stop"
                event.draft = self.backend.draft_stats(out.request_id)
                self._finish(ticket, event)
            else:
                ticket.deliver(event)

    def _finish(self, ticket: Ticket, event: StreamEvent) -> None:
        self._active.pop(ticket.request_id, None)
        self.admission.release(ticket)
        self._on_finish(ticket, event)
        ticket.deliver(event)

    def _fail_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[0] == "submit":
                reason = f"engine failed: {self.error}" if self.error else "server is shutting down"
                command[1].deliver(StreamEvent(error=reason, error_status=503))
