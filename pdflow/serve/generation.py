"""One request's life on the server: submit to the engine loop, then answer as one JSON
body or as server-sent events (``data: {chunk}`` lines, ending ``data: [DONE]``).

The first event is awaited before any header goes out, so a prompt the engine refuses is
still a proper 4xx. A client that disconnects aborts its request and frees its blocks.
A request still unanswered after ``timeout_s`` is aborted too and answered 503: its client
learns in bounded time, whatever happened below (a stuck transfer, a slow engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.engine_loop import EngineLoop, StreamEvent, Ticket
from pdflow.serve.errors import APIError
from pdflow.serve.metrics import ServeMetrics

_DISCONNECTED = StreamEvent(error="client disconnected", error_status=499)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass(kw_only=True, slots=True)
class Job:
    """A validated request: what to generate and how to answer."""

    chat: bool
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool


@dataclass(kw_only=True, slots=True)
class _Progress:
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    draft: object = None

    def add(self, event: StreamEvent) -> None:
        self.text += event.text
        self.tokens += len(event.token_ids)
        if event.finish_reason is not None:
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
            self.draft = event.draft


class Generation:
    def __init__(self, loop: EngineLoop, metrics: ServeMetrics, job: Job, request: Request, *,
                 timeout_s: float | None = None):
        self.loop, self.metrics, self.job, self.request = loop, metrics, job, request
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.progress = _Progress()
        self.ticket: Ticket | None = None
        self.events: asyncio.Queue | None = None

    async def respond(self) -> Response:
        self.ticket, self.events = self.loop.open_stream(self.job.prompt_token_ids, self.job.sampling)
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            events = [await self._next()]
            while not events[-1].done and not self.job.stream:
                events.append(await self._next())
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            self.progress.finish_reason = "error"
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

    # -- events --------------------------------------------------------------------------

    async def _watch_disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.events.put_nowait(_DISCONNECTED)

    async def _next(self) -> StreamEvent:
        if self.deadline is None:
            return self._accept(await self.events.get())
        try:
            event = await asyncio.wait_for(self.events.get(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self.loop.abort(self.ticket)
            self.progress.finish_reason = "error"
            raise APIError(503, f"the request did not finish within {self.timeout_s:g} s and was aborted",
                           code="request_timeout") from None
        return self._accept(event)

    def _accept(self, event: StreamEvent) -> StreamEvent:
        """Fold an event into the answer; an error event becomes this request's APIError."""
        if event is _DISCONNECTED:
            self._abort()
            raise ClientGone()
        if event.error is not None:
            code = ("server_overloaded" if event.retry_after_s is not None
                    else "engine_error" if event.error_status >= 500 else "invalid_value")
            raise APIError(event.error_status, event.error, code=code,
                           param="prompt" if event.error_status == 400 else None,
                           retry_after_s=event.retry_after_s)
        self.progress.add(event)
        if event.finish_reason is not None:
            self._count(event.finish_reason)
        return event

    def _drain(self) -> list[StreamEvent]:
        """Everything already queued: tokens that arrived together go in one chunk."""
        out = []
        while not self.events.empty() and (not out or not out[-1].done):
            out.append(self.events.get_nowait())
        return out

    def _abort(self) -> None:
        if self.progress.finish_reason is None:
            self.loop.abort(self.ticket)
            self.metrics.count("abort")
            self.progress.finish_reason = "abort"

    def _count(self, reason: str) -> None:
        self.metrics.count("length" if reason == "length" else "abort" if reason == "abort" else "stop")

    # -- bodies ---------------------------------------------------------------------------

    def _usage(self) -> dict:
        n = len(self.job.prompt_token_ids)
        usage = {"prompt_tokens": n, "completion_tokens": self.progress.tokens,
                 "total_tokens": n + self.progress.tokens}
        draft = self.progress.draft
        if draft is not None:
            usage |= {"num_draft_tokens": draft.drafted, "num_accepted_draft_tokens": draft.accepted,
                      "num_verify_steps": draft.verify_steps}
        return usage

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.job.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.job.model}

    def _body(self) -> dict:
        text, reason = self.progress.text, self.progress.finish_reason
        if self.job.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._head(False) | {"choices": [choice], "usage": self._usage()}

    def _chunk(self, text: str, reason: str | None, *, role: bool = False) -> bytes:
        if self.job.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text or role else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = self._head(True) | {"choices": [choice]}
        if self.job.include_usage:
            body["usage"] = None
        return _sse(body)

    async def _event_stream(self, first: list[StreamEvent]) -> AsyncIterator[bytes]:
        pending, role = first, self.job.chat
        try:
            while True:
                text = "".join(e.text for e in pending)
                reason = self.progress.finish_reason if pending[-1].done else None
                yield self._chunk(text, reason, role=role)
                role = False
                if pending[-1].done:
                    break
                pending = [await self._next()]
                pending += [self._accept(e) for e in self._drain()]
            if self.job.include_usage:
                yield _sse(self._head(True) | {"choices": [], "usage": self._usage()})
            yield b"data: [DONE]\n\n"
        except ClientGone:
            return
        except APIError as exc:  # the engine failed mid-stream: say so, then end the stream
            self.progress.finish_reason = "error"
            self.metrics.count("error")
            yield _sse(exc.body())
        finally:
            self._abort()


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
