"""The serving state one thread drives: a backend, its admission, and the requests in it.

Why a class of its own: two drivers step it. ``EngineLoop`` runs it on a thread of the
API server's process (an instance served in process: ``pd_instance``, tests), and the
engine-core process (``core_process``) runs it in its busy loop, fed by ZMQ messages from
the API front processes. Either way exactly one thread calls it; every event a request
gets goes out through its ticket's ``deliver``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.admission import Admission, AdmissionPolicy
from pdflow.serve.backend import DraftStats, ServingBackend
from pdflow.serve.pd_wire import RouteRefused

if TYPE_CHECKING:
    from pdflow.serve.pd_wire import PDRoute


@dataclass(kw_only=True, slots=True)
class StreamEvent:
    """Tokens for one request since the previous event, or its end (``finish_reason``),
    or a failure (``error``; ``error_status`` 400 for a refused prompt, 503 for an
    overloaded server (with ``retry_after_s``), 500 otherwise). A field added here rides
    the engine-core wire once it is added to ``core_wire.Delta`` too (same name)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    draft: DraftStats | None = None
    error: str | None = None
    error_status: int = 500
    error_param: str | None = None  # the request body's field a 400 is about, if one
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
    """One request as the core tracks it; ``request_id`` is set once the backend took it.
    ``route``: its part in a P/D exchange between separate instances (None: served whole)."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    deliver: Callable[[StreamEvent], None]
    route: PDRoute | None = None
    arrival: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    admitted_at: float | None = None  # into the engine, out of the waiting room
    last_token_at: float | None = None
    cancelled: bool = False


def step_kind(outputs: list[TokenOutput], active: dict[str, Ticket]) -> str:
    """``prefill`` when the step gave some request its first token, ``decode`` when every
    row continued a stream, ``empty`` when it gave none (a pipeline filling, a transfer)."""
    if not outputs:
        return "empty"
    firsts = (t is not None and t.last_token_at is None for t in (active.get(o.request_id) for o in outputs))
    return "prefill" if any(firsts) else "decode"


class ServingCore:
    """Admission, then the backend; ``on_token(ticket, now)`` and ``on_finish(ticket,
    event)`` let metrics observe latencies where tokens leave the engine; ``on_step(kind,
    rows, seconds)`` each busy turn's period (see ``turn``)."""

    def __init__(self, backend: ServingBackend, *, on_token=None, on_finish=None, on_step=None,
                 admission: AdmissionPolicy | None = None, clock: Callable[[], float] = time.perf_counter):
        self.backend = backend
        self._clock = clock
        self.admission = Admission(admission or AdmissionPolicy(), num_blocks=backend.num_kv_blocks,
                                   block_size=backend.block_size)
        self.active: dict[str, Ticket] = {}
        self._on_token = on_token or (lambda ticket, now: None)
        self._on_finish = on_finish or (lambda ticket, event: None)
        self._on_step = on_step or (lambda kind, rows, seconds: None)
        # The last turn while requests stayed in: its start, kind and rows (None: idle since)
        self._busy_turn: tuple[float, str, int] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.active) or self.admission.num_waiting > 0

    def offer(self, ticket: Ticket) -> None:
        """A new request: into the waiting room, or refused (503) when it is full."""
        if ticket.cancelled:
            self._end_unadmitted(ticket)
        elif not self.admission.offer(ticket, len(ticket.prompt_token_ids)):
            self._refuse(ticket, f"the server is at capacity ({self.admission.num_waiting} requests waiting "
                                 "for KV blocks); retry later")

    def cancel(self, ticket: Ticket) -> None:
        """Its client went away: out of the engine or out of the waiting room."""
        ticket.cancelled = True
        if ticket.request_id in self.active:
            self.backend.abort(ticket.request_id)
            self.finish(ticket, StreamEvent(finish_reason="abort"))
        elif self.admission.withdraw(ticket):
            self._end_unadmitted(ticket)

    def _end_unadmitted(self, ticket: Ticket) -> None:
        """Aborted before the engine had it. Its event is delivered too: an API request's
        client is gone, but a producer's prefill route waits for it to answer the consumer."""
        event = StreamEvent(finish_reason="abort")
        self._on_finish(ticket, event)
        ticket.deliver(event)

    def turn(self) -> None:
        """Admit what fits, then one engine step. A turn that leaves requests in the
        engine is followed at once by the next (neither driver waits while busy), so the
        time between their starts is that step as served (intake, step, delivery) and is
        reported to ``on_step``, by the step's kind and rows; a gap that may hold an idle
        wait is not."""
        start = self._clock()
        if self._busy_turn is not None:
            began, kind, rows = self._busy_turn
            self._on_step(kind, rows, start - began)
        for ticket in self.admission.expired():
            self._refuse(ticket, f"no KV blocks came free within {self.admission.policy.queue_timeout_s:g} s; "
                                 "retry later")
        for ticket in self.admission.ready():
            self._admit(ticket)
        # Stepped even with no request of its own left: an aborted request whose KV is in
        # flight ends (and frees its blocks) only when the transfer settles. Cheap when idle.
        outputs = self.backend.step()
        kind = step_kind(outputs, self.active)
        self._deliver(outputs)
        self._busy_turn = (start, kind, len(outputs)) if self.active else None

    def fail_all(self, reason: str, status: int) -> None:
        """End every request (the engine died, or the server stops)."""
        for ticket in list(self.active.values()):
            self.finish(ticket, StreamEvent(error=reason, error_status=status))
        for ticket in self.admission.drain():
            self.finish(ticket, StreamEvent(error=reason, error_status=status))

    def finish(self, ticket: Ticket, event: StreamEvent) -> None:
        self.active.pop(ticket.request_id, None)
        self.admission.release(ticket)
        self._on_finish(ticket, event)
        ticket.deliver(event)

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
            ticket.request_id = self.backend.add(ticket.prompt_token_ids, ticket.sampling, route=ticket.route)
            ticket.admitted_at = time.monotonic()
        except ValueError as exc:
            self.finish(ticket, StreamEvent(error=str(exc), error_status=400,
                                            error_param=None if isinstance(exc, RouteRefused) else "prompt"))
            return
        except Exception as exc:  # the engine cannot take requests: this one ends, then the core
            self.finish(ticket, StreamEvent(error=f"engine failed: {type(exc).__name__}: {exc}", error_status=503))
            raise
        self.active[ticket.request_id] = ticket

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            ticket = self.active.get(out.request_id)
            if ticket is None:  # aborted after the step produced it
                if out.finished:
                    self.backend.draft_stats(out.request_id)  # drop its counts
                continue
            if out.error is not None:  # a fault ended it (a lost instance, a failed KV transfer)
                self.finish(ticket, StreamEvent(error=out.error, error_status=502))
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
                self.finish(ticket, event)
            else:
                ticket.deliver(event)
