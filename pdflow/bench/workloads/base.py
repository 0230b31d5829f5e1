"""What a workload is: requests to send, and how to score what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(kw_only=True, slots=True)
class WorkRequest:
    """One completion request. ``arrival_s``: when to send it, in seconds after the
    workload starts (None: as soon as concurrency allows). ``meta``: what the scorer
    needs (gold answer, depth, ...)."""

    prompt: str | list[int]
    max_tokens: int
    temperature: float = 0.0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    arrival_s: float | None = None
    meta: dict = field(default_factory=dict)
    # Ask for the answer's token ids (the API's ``return_token_ids``): a multi-turn
    # conversation extends its next turn by them.
    return_token_ids: bool = False


@dataclass(kw_only=True, slots=True)
class RequestResult:
    """What the client saw. Times are seconds from sending; ``itl_s`` holds the gaps
    between the chunks after the first. Draft counts come from the server's usage
    (``num_draft_tokens`` ...) when it reports them."""

    ok: bool
    text: str = ""
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    sent_at_s: float = 0.0
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None
    num_verify_steps: int | None = None
    # usage.prompt_tokens_details.cached_tokens, when the server reports it.
    cached_tokens: int | None = None
    # The answer's token ids, when the request asked for them (``return_token_ids``).
    token_ids: list[int] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class WorkloadResult:
    """``metrics``: flat name -> number (what MLflow logs); ``rows``: one per request
    (results.json); ``breakdowns``: titled name -> value series for plots; ``per_workload``:
    each workload's own figures, unprefixed (latency and task metrics, plus ``accuracy``
    where the workload names one), for the one-row-per-workload table."""

    name: str
    metrics: dict[str, float]
    rows: list[dict]
    breakdowns: dict[str, dict[str, float]] = field(default_factory=dict)
    per_workload: dict[str, dict[str, float]] = field(default_factory=dict)


class Workload(Protocol):
    name: str
    # The task metric that is this workload's accuracy (the table's column); None: none.
    accuracy_metric: str | None

    def requests(self) -> list[WorkRequest]: ...

    def score(self, requests: list[WorkRequest], results: list[RequestResult]) -> tuple[
        dict[str, float], dict[str, dict[str, float]]
    ]:
        """Task metrics and breakdowns; latency metrics are added by the runner."""


@runtime_checkable
class TurnTaking(Protocol):
    """A closed-loop workload: ``requests()`` are the first turns, and each answer may
    make the next request (a chat client's conversation). The runner drives such a
    workload with ``client.drive_turns``."""

    closed_loop: bool

    def follow_up(self, request: WorkRequest, result: RequestResult) -> WorkRequest | None:
        """The request that comes once ``request`` was answered with ``result``; None: none."""


class WorkloadFailed(RuntimeError):
    """Every request of a workload failed: nothing to measure."""
