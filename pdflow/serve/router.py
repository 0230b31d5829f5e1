"""A router with the instance API: forwards each request to a backend URL (picked under
``router.policy``) and streams the answer back unchanged.

With ``prefill`` URLs the backends are decode instances, and each generation request
goes to one with a prefill instance named in its ``x-pdflow-prefill`` header, which has
that one prefill it (``pd_decode``). A backend's own answer, 4xx included, passes
through; an unreachable backend is skipped for the next (none: 503); a failed one (5xx,
a cut stream) gives 502, except its own 503 (overloaded, with ``Retry-After``; or
unavailable: its engine down, stopping or lost, a request timed out), which passes through
with its body, so the client reads the backend's reason rather than "bad gateway". A
backend that stalls (no answer, or no next chunk) past ``upstream_timeout_s`` ends the
request with 503 ``request_timeout`` (mid-stream: an error event) and closes the upstream,
which aborts it there. Every error has the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.requests import ClientDisconnect

from pdflow.serve.api import GENERATION_BODIES, bearer_guard, install_error_handlers
from pdflow.serve.errors import APIError, error_body
from pdflow.serve.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from pdflow.serve.openapi import install_openapi
from pdflow.serve.pd_wire import PREFILL_HEADER
from pdflow.serve.router_policy import Chooser, poll_free
from pdflow.spec.router import RouterSpec

__all__ = ["create_router"]

FORWARDED_HEADERS = ("content-type", "accept")
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# With no request timeout set, a backend silent this long is taken for stuck: never a hang.
UPSTREAM_STALL_S = 600.0


def upstream_timeout_s(request_timeout_s: float | None) -> float:
    """How long the router waits for a backend's answer or its next chunk: twice
    ``serve.request_timeout_s`` when set (the backend's own 503 comes first; this ends the
    request where a backend does not enforce it), else ``UPSTREAM_STALL_S``."""
    return UPSTREAM_STALL_S if request_timeout_s is None else 2 * request_timeout_s


def create_router(backends: list[str], *, api_key: str | None = None,
                  backend_api_key: str | None = None, request_timeout_s: float | None = None,
                  prefill: list[str] | None = None,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                  router: RouterSpec | None = None, block_tokens: int = 16) -> FastAPI:
    """``backend_api_key`` (default: ``api_key``) is sent to the backends; ``block_tokens``:
    the instances' KV block size, which the prefix policy cuts prompts by;
    ``request_timeout_s``: ``serve.request_timeout_s`` (``upstream_timeout_s``)."""
    chooser = Chooser(backends, prefill, router or RouterSpec(), block_tokens=block_tokens)
    picker, producers = chooser.decode, chooser.prefill
    registry = CollectorRegistry()
    outcomes = Counter("pdflow_router_requests", "Forwarded requests by backend and outcome.",
                       ["backend", "outcome"], registry=registry)
    registry.register(_LocalPrefills(chooser))
    forward_key = backend_api_key if backend_api_key is not None else api_key
    stall_s = upstream_timeout_s(request_timeout_s)
    client = httpx.AsyncClient(timeout=httpx.Timeout(stall_s, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        polling = None
        if chooser.router.policy != "round_robin":  # load and prefix read the instances' free blocks
            auth = {"authorization": f"Bearer {forward_key}"} if forward_key else None
            polling = asyncio.create_task(poll_free(chooser, client, headers=auth))
        yield
        if polling is not None:
            polling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await polling
        await client.aclose()

    app = FastAPI(title="pdflow router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    guard = [Depends(bearer_guard(api_key))]
    install_error_handlers(app)
    install_openapi(app, guard, GENERATION_BODIES)

    def count(backend: str, outcome: str) -> None:
        outcomes.labels(backend=backend, outcome=outcome).inc()

    def headers_for(request: Request) -> dict:
        out = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        if forward_key:
            out["authorization"] = f"Bearer {forward_key}"
        return out

    async def forward(request: Request, *, paired: bool = False) -> Response:
        body = await request.body()
        headers = headers_for(request)
        choice = chooser.choose(body if paired else None)
        if choice.producer is not None:
            headers[PREFILL_HEADER] = choice.producer
        unreachable = []
        for backend in choice.order:
            upstream = client.build_request(request.method, backend + request.url.path, content=body,
                                            headers=headers)
            chooser.started(choice, backend)  # load from the send on: its prefill is the costly part
            try:
                answer = await until_answered_or_gone(request, client.send(upstream, stream=True))
            except BaseException as exc:
                chooser.finished(choice, backend)
                if isinstance(exc, CONNECT_ERRORS):
                    count(backend, "unreachable")
                    unreachable.append(f"{backend} ({type(exc).__name__})")
                    continue
                if isinstance(exc, httpx.TimeoutException):
                    count(backend, "timed_out")
                    raise APIError(503, f"backend {backend} did not answer within {stall_s:g} s",
                                   code="request_timeout") from exc
                if isinstance(exc, httpx.HTTPError):
                    count(backend, "failed")
                    raise APIError(502, f"backend {backend} failed: {type(exc).__name__}: {exc}",
                                   code="backend_error") from exc
                raise  # the client left, or the server is stopping
            chooser.prefilled(choice)  # answered: a stream's first token is out, the prefill done
            return await relay(backend, answer, lambda b=backend: chooser.finished(choice, b))
        raise APIError(503, f"no backend could be reached: {', '.join(unreachable)}", code="no_backend")

    async def until_answered_or_gone(request: Request, sending) -> httpx.Response:
        """The backend's answer, or ``ClientDisconnect`` (a 499, logged nowhere) once the
        client left first: the upstream is closed then, so the backend aborts the request
        instead of running it (a prefill held mid-transfer, say) for nobody."""
        send = asyncio.ensure_future(sending)
        gone = asyncio.ensure_future(request.receive())  # the body is read: only a disconnect comes
        try:
            await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not send.done():
                send.cancel()
        if send.cancelled():
            raise ClientDisconnect()
        return send.result()

    async def relay(backend: str, answer: httpx.Response, done: Callable[[], None]) -> Response:
        """The backend's answer; ``done`` once it has been read to the end (or failed)."""
        media = answer.headers.get("content-type", "application/json")
        if answer.status_code < 500 and media.startswith("text/event-stream"):
            count(backend, "ok")
            return StreamingResponse(stream_through(backend, answer, done), status_code=answer.status_code,
                                     media_type=media, headers={"Cache-Control": "no-cache"})
        try:
            content = await answer.aread()
            await answer.aclose()
        finally:
            done()
        if answer.status_code == 503:  # the backend's own refusal: its reason passes through
            retry = answer.headers.get("retry-after")
            count(backend, "overloaded" if retry is not None else "unavailable")
            return Response(content, status_code=503, media_type=answer.headers.get("content-type"),
                            headers={"Retry-After": retry} if retry is not None else None)
        if answer.status_code >= 500:
            count(backend, "failed")
            raise APIError(502, f"backend {backend} answered {answer.status_code}: "
                           f"{content.decode(errors='replace')[:500]}", code="backend_error")
        count(backend, "ok" if answer.status_code < 400 else "rejected")
        return Response(content, status_code=answer.status_code, media_type=media)

    async def stream_through(backend: str, answer: httpx.Response, done: Callable[[], None]) -> AsyncIterator[bytes]:
        """Bytes as they come; a cut stream ends with an error event instead of [DONE].
        Leaving early (the client went away) closes the upstream, which aborts there."""
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.TimeoutException:
            count(backend, "timed_out")
            body = error_body(503, f"backend {backend} sent nothing for {stall_s:g} s",
                              code="request_timeout")
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
        except httpx.HTTPError as exc:
            count(backend, "failed")
            body = error_body(502, f"backend {backend} failed mid-stream: {type(exc).__name__}",
                              code="backend_error")
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
        finally:
            done()
            await answer.aclose()

    @app.get("/health")
    async def health():
        states = {}
        for backend in [*picker.backends, *(producers.backends if producers else ())]:
            try:
                r = await client.get(backend + "/health", timeout=5.0)
                states[backend] = "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                states[backend] = type(exc).__name__
        groups = [picker.backends] + ([producers.backends] if producers else [])
        if not all(any(states[b] == "ok" for b in group) for group in groups):
            return JSONResponse(error_body(503, f"no healthy backend: {states}", code="no_backend")
                                | {"backends": states}, status_code=503)
        return {"status": "ok", "backends": states}

    @app.get("/metrics", dependencies=guard)
    async def prometheus():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guard)
    async def models(request: Request):
        return await forward(request)

    @app.post("/v1/completions", dependencies=guard)
    async def completions(request: Request):
        return await forward(request, paired=True)

    @app.post("/v1/chat/completions", dependencies=guard)
    async def chat_completions(request: Request):
        return await forward(request, paired=True)

    return app


class _LocalPrefills:
    """``pdflow_router_local_prefills_total``: requests sent without a prefill instance
    because every one was saturated (the decode instance prefilled them)."""

    def __init__(self, chooser: Chooser):
        self.chooser = chooser

    def collect(self):
        yield CounterMetricFamily("pdflow_router_local_prefills", "Requests the decode instance prefilled: "
                                  "every prefill instance was saturated.", value=self.chooser.local_prefills)
