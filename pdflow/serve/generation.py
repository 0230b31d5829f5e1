"""One request's life on the server: submit its choices to the engine loop (``n`` of
them, each its own engine request), then answer as one JSON body or as server-sent events
(``data: {chunk}`` lines, ending ``data: [DONE]``).

The first event is awaited before any header goes out, so a prompt the engine refuses is
still a proper 4xx. A client that disconnects aborts its request and frees its blocks.
A request still unanswered after ``timeout_s`` is aborted too and answered 503: its client
learns in bounded time, whatever happened below (a stuck transfer, a slow engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.engine_loop import EngineLoop
from pdflow.serve.errors import APIError
from pdflow.serve.logprob_bodies import LogprobRun, chat_logprobs, completion_logprobs, prompt_run
from pdflow.serve.metrics import ServeMetrics
from pdflow.serve.serving_core import StreamEvent

if TYPE_CHECKING:
    from pdflow.serve.pd_wire import PDRoute

_DISCONNECTED = StreamEvent(error="client disconnected", error_status=499)
_TIMED_OUT = StreamEvent(error="request timed out", error_status=503)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass(kw_only=True, slots=True)
class Job:
    """A validated request: what to generate and how to answer. ``logprobs``: the top k
    to report per token (None: no logprobs); ``echo``: the prompt's text (and, with
    ``logprobs``, its tokens' logprobs) first."""

    chat: bool
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    prompt_text: str = ""
    tokenizer: object = None
    return_token_ids: bool = False


@dataclass(kw_only=True, slots=True)
class _Choice:
    index: int
    ticket: object | None = None  # the loop's or the engine-core client's ticket
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    draft: object = None
    run: LogprobRun = field(default_factory=LogprobRun)
    first: StreamEvent | None = None  # its first event: prompt logprobs, cached tokens
    role_sent: bool = False
    echoed: bool = False
    prompt_ids_sent: bool = False
    outcome: str = ""  # the engine's finish reason, as metrics count it

    def add(self, event: StreamEvent) -> None:
        self.first = self.first or event
        self.text += event.text
        self.tokens += len(event.token_ids)
        self.run.extend(event.token_ids, list(event.logprobs), event.top_logprobs)
        if event.finish_reason is not None:
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
            self.outcome = event.finish_reason
            self.draft = event.draft


class Generation:
    def __init__(self, loop: EngineLoop, metrics: ServeMetrics, job: Job, request: Request, *,
                 timeout_s: float | None = None, route: PDRoute | None = None):
        self.loop, self.metrics, self.job, self.request = loop, metrics, job, request
        self.route = route  # every choice's (each its own engine request)
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice(index=i) for i in range(job.n)]
        self.events: asyncio.Queue | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.counted = False

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def respond(self) -> Response:
        self.events = asyncio.Queue()
        for choice in self.choices:
            choice.ticket = self._open(choice.index)
        if self.deadline is not None:  # one timer, not a wait_for per token
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, self.deadline - time.monotonic()), self.events.put_nowait, (-1, _TIMED_OUT))
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            events = [await self._next()]
            while not self.done and not self.job.stream:
                events.append(await self._next())
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            self._abort("error")
            raise
        except BaseException:  # the server cancelled the handler (shutdown)
            self._abort()
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher  # one reader of the ASGI receive channel at a time
        if not self.job.stream:
            return JSONResponse(self._body())
        return StreamingResponse(
            self._event_stream(events), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _open(self, index: int):
        """Choice ``index`` as its own engine request; a seeded request's choice i draws
        from seed + i (vLLM's rule), so choices differ and a seed repeats them all. Its
        events join the generation's queue tagged with ``index`` (the same for the
        in-process loop and the engine-core client: both answer ``open_stream``)."""
        sampling = self.job.sampling
        if index and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
        ticket, _ = self.loop.open_stream(self.job.prompt_token_ids, sampling, into=self.events, tag=index,
                                          route=self.route)
        return ticket

    # -- events --------------------------------------------------------------------------

    async def _watch_disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.events.put_nowait((-1, _DISCONNECTED))

    async def _next(self) -> tuple[int, StreamEvent]:
        return self._accept(await self.events.get())

    def _accept(self, item: tuple[int, StreamEvent]) -> tuple[int, StreamEvent]:
        """Fold an event into its choice; an error event becomes this request's APIError."""
        index, event = item
        if event is _DISCONNECTED:
            self._abort()
            raise ClientGone()
        if event is _TIMED_OUT:
            self._abort("error")
            raise APIError(503, f"the request did not finish within {self.timeout_s:g} s and was aborted",
                           code="request_timeout")
        choice = self.choices[index]
        if event.error is not None:
            choice.finish_reason = "error"
            code = ("server_overloaded" if event.retry_after_s is not None
                    else "engine_error" if event.error_status >= 500 else "invalid_value")
            raise APIError(event.error_status, event.error, code=code,
                           param=event.error_param,
                           retry_after_s=event.retry_after_s)
        choice.add(event)
        if self.done and self._timer is not None:
            self._timer.cancel()
        if self.done and not self.counted:
            self.counted = True
            reason = self.choices[0].outcome
            self.metrics.count(reason if reason in ("length", "abort") else "stop")
        return item

    def _drain(self) -> list[tuple[int, StreamEvent]]:
        """Everything already queued: tokens that arrived together go in one chunk."""
        out = []
        while not self.events.empty():
            out.append(self._accept(self.events.get_nowait()))
        return out

    def _abort(self, reason: str = "abort") -> None:
        """End every choice still running (the others finished in the engine already)."""
        aborted = False
        for choice in self.choices:
            if choice.finish_reason is None and choice.ticket is not None:
                self.loop.abort(choice.ticket)
                choice.finish_reason, aborted = reason, True
        if self._timer is not None:
            self._timer.cancel()
        if aborted and not self.counted and reason == "abort":
            self.counted = True
            self.metrics.count("abort")

    # -- bodies ---------------------------------------------------------------------------

    def _usage(self) -> dict:
        n, completion = len(self.job.prompt_token_ids), sum(c.tokens for c in self.choices)
        first = self.choices[0].first
        usage = {"prompt_tokens": n, "completion_tokens": completion, "total_tokens": n + completion,
                 "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens if first else 0}}
        drafts = [c.draft for c in self.choices if c.draft is not None]
        if drafts:
            usage |= {"num_draft_tokens": sum(d.drafted for d in drafts),
                      "num_accepted_draft_tokens": sum(d.accepted for d in drafts),
                      "num_verify_steps": sum(d.verify_steps for d in drafts)}
        return usage

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.job.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.job.model}

    def _echo(self, choice: _Choice) -> tuple[str, LogprobRun]:
        """What an echo puts before the choice's first tokens (once): the prompt's text,
        and its tokens' logprobs when asked (computed where the prompt was prefilled)."""
        job = self.job
        if not job.echo or choice.echoed:
            return "", LogprobRun()
        choice.echoed = True
        if job.logprobs is None:
            return job.prompt_text, LogprobRun()
        first = choice.first
        scored = first.prompt_logprobs if first is not None else None
        if scored is None or len(scored) != len(job.prompt_token_ids) - 1:
            raise APIError(501, "this deployment did not compute the prompt's logprobs; echo with logprobs "
                           "needs the prompt prefilled by this server or its P/D deployment",
                           param="echo", code="unsupported")
        return job.prompt_text, prompt_run(job.prompt_token_ids, scored, first.prompt_top_logprobs)

    def _logprobs(self, head: LogprobRun, run: LogprobRun, offset: int) -> dict | None:
        job = self.job
        if job.logprobs is None:
            return None
        both = LogprobRun()
        both.extend(head.token_ids, head.logprobs, head.tops)
        both.extend(run.token_ids, run.logprobs, run.tops)
        if job.chat:
            return chat_logprobs(job.tokenizer, both, job.logprobs)
        return completion_logprobs(job.tokenizer, both, job.logprobs, offset)

    def _body(self) -> dict:
        choices = []
        for c in self.choices:
            echo_text, head = self._echo(c)
            logprobs = self._logprobs(head, c.run, 0)
            if self.job.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": echo_text + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
            choices[-1] |= self._token_ids(c, c.run.token_ids)
        return self._head(False) | {"choices": choices, "usage": self._usage()}

    def _token_ids(self, choice: _Choice, token_ids: list[int]) -> dict:
        """``return_token_ids``: these output ids, and the prompt's once per choice."""
        if not self.job.return_token_ids:
            return {}
        ids = {"token_ids": list(token_ids)}
        if not choice.prompt_ids_sent:
            choice.prompt_ids_sent = True
            ids["prompt_token_ids"] = list(self.job.prompt_token_ids)
        return ids

    def _chunk(self, choice: _Choice, events: list[StreamEvent]) -> bytes:
        text = "".join(e.text for e in events)
        reason = choice.finish_reason if events[-1].done else None
        run = LogprobRun()
        for e in events:
            run.extend(e.token_ids, list(e.logprobs), e.top_logprobs)
        echo_text, head = self._echo(choice)
        # Where this chunk's first token starts in the choice's text (the echo's, if any).
        offset = (len(self.job.prompt_text) if self.job.echo else 0) + len(choice.text) - len(text)
        logprobs = self._logprobs(head, run, 0 if head.token_ids else offset)
        if self.job.chat:
            role, choice.role_sent = not choice.role_sent, True
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text or role else {})
            body_choice = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            body_choice = {"index": choice.index, "text": echo_text + text, "logprobs": logprobs,
                           "finish_reason": reason}
        body = self._head(True) | {"choices": [body_choice | self._token_ids(choice, run.token_ids)]}
        if self.job.include_usage:
            body["usage"] = None
        return _sse(body)

    async def _event_stream(self, first: list[tuple[int, StreamEvent]]) -> AsyncIterator[bytes]:
        pending = first
        try:
            while True:
                for index in dict.fromkeys(i for i, _ in pending):  # per choice, in arrival order
                    yield self._chunk(self.choices[index], [e for i, e in pending if i == index])
                if self.done:
                    break
                pending = [await self._next()]
                pending += self._drain()
            if self.job.include_usage:
                yield _sse(self._head(True) | {"choices": [], "usage": self._usage()})
            yield b"data: [DONE]\n\n"
        except ClientGone:
            return
        except APIError as exc:  # the engine failed mid-stream: say so, then end the stream
            self._abort("error")
            self.metrics.count("error")
            yield _sse(exc.body())
        finally:
            self._abort()


def _sse(body: dict) -> bytes:
    """One server-sent event (msgspec's JSON: a chunk per token per stream is the front's hot path)."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
