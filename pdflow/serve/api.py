"""The OpenAI-compatible HTTP API of one instance (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus),
``GET /openapi.json`` (the request schemas, for clients and fuzzers).
With an API key, every route but ``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.admission import AdmissionPolicy
from pdflow.serve.backend import ServingBackend
from pdflow.serve.chat import chat_prompt_ids
from pdflow.serve.engine_loop import EngineLoop
from pdflow.serve.errors import APIError, error_body, from_validation
from pdflow.serve.generation import Generation, Job
from pdflow.serve.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from pdflow.serve.metrics import ServeMetrics
from pdflow.serve.openapi import install_openapi
from pdflow.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

if TYPE_CHECKING:
    from pdflow.serve.pd_wire import PDRoute

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
GENERATION_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class EngineHost:
    """A backend, the loop that steps it, and its metrics: what the API serves.
    ``route_of``: a generation request's P/D route, read from its HTTP request (a decode
    instance's: the router's header); None: every request is served whole."""

    def __init__(self, backend: ServingBackend, *, admission: AdmissionPolicy | None = None,
                 route_of: Callable[[Request], PDRoute | None] | None = None):
        self.backend = backend
        self.route_of = route_of
        self.metrics = ServeMetrics(backend, num_active=lambda: self.loop.num_active)
        self.loop = EngineLoop(backend, on_token=self.metrics.on_token, on_finish=self.metrics.on_finish,
                               on_step=self.metrics.on_step, admission=admission)

    def start(self) -> EngineHost:
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()

    async def metrics_text(self) -> bytes:
        return self.metrics.render()


def bearer_guard(api_key: str | None):
    """A dependency refusing requests without ``Authorization: Bearer <api_key>``. A
    coroutine: FastAPI runs a plain function dependency on its thread pool, a thread
    hand-off on every request of every route (the router's and the instance's both)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    return check


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Every error, FastAPI's own included, as an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if on_error is not None:
            on_error(request, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc.errors()[0].get("msg"))), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):  # left while sending its body
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code), status_code=exc.status_code)


def create_app(host: EngineHost, *, model_name: str, api_key: str | None = None,
               request_timeout_s: float | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """``request_timeout_s``: a generation still running after it is aborted (503). ``host``:
    an ``EngineHost`` (the engine on a thread here) or a ``front_process.RemoteHost`` (the
    engine core in a process of its own); ``host.backend`` and ``host.route_of`` are read
    per request."""
    metrics = host.metrics
    app = FastAPI(title="pdflow", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    guard = [Depends(bearer_guard(api_key))]
    install_openapi(app, guard, GENERATION_BODIES)
    created = int(time.time())

    def count_refusal(request: Request, exc: APIError) -> None:
        if request.url.path in GENERATION_PATHS:
            refused = exc.status < 500 or exc.retry_after_s is not None  # overloaded: not a fault
            metrics.count("rejected" if refused else "error")

    install_error_handlers(app, count_refusal)

    def route_of(request: Request) -> PDRoute | None:
        return None if host.route_of is None else host.route_of(request)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "pdflow",
                "max_model_len": host.backend.max_model_len}

    @app.get("/health")
    async def health():
        if not host.loop.healthy:
            raise APIError(503, f"engine is not running: {host.loop.error or 'stopped'}", code="engine_down")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=guard)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=guard)
    async def model(name: str):
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics", dependencies=guard)
    async def prometheus():
        return Response(await host.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=guard)
    async def completions(request: Request):
        req = _parse(CompletionRequest, await request.body())
        _check_model(req.model, model_name)
        ids = _prompt_ids(host.backend, req.prompt)
        job = _job(host.backend, req, ids, chat=False, model_name=model_name,
                   default_max=COMPLETION_DEFAULT_MAX_TOKENS)
        return await Generation(host.loop, metrics, job, request, timeout_s=request_timeout_s,
                                route=route_of(request)).respond()

    @app.post("/v1/chat/completions", dependencies=guard)
    async def chat_completions(request: Request):
        req = _parse(ChatCompletionRequest, await request.body())
        _check_model(req.model, model_name)
        ids = chat_prompt_ids(host.backend.tokenizer, [(m.role, m.content) for m in req.messages])
        job = _job(host.backend, req, ids, chat=True, model_name=model_name, default_max=None)
        return await Generation(host.loop, metrics, job, request, timeout_s=request_timeout_s,
                                route=route_of(request)).respond()

    return app


def _parse(model, body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{served}`).",
                       param="model", code="model_not_found")


def _prompt_ids(backend: ServingBackend, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if backend.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids",
                           param="prompt", code="invalid_value")
        return backend.tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < backend.vocab_size]
    if bad:
        raise APIError(400, f"token ids must be in [0, {backend.vocab_size}); got {bad[:5]}",
                       param="prompt", code="invalid_value")
    return prompt


def _job(backend: ServingBackend, req: SamplingFields, ids: list[int], *, chat: bool, model_name: str,
         default_max: int | None) -> Job:
    """Length and range checks against this model, then the engine's SamplingParams."""
    limit, n = backend.max_model_len, len(ids)
    where = "messages" if chat else "prompt"
    if n >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, and your "
                       f"{where} has {n} tokens, leaving no room for a completion.",
                       param=where, code="context_length_exceeded")
    wanted = req.max_new_tokens if chat else req.max_tokens
    max_tokens = wanted if wanted is not None else (default_max or limit - n)
    if n + max_tokens > limit:
        name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                       f"requested {n + max_tokens} tokens ({n} in the {where}, {max_tokens} for the "
                       f"completion). Please reduce the {where} or {name}.",
                       param=name, code="context_length_exceeded")
    choices = req.n or 1
    blocks = choices * -(-(n + 1) // backend.block_size)  # what admission reserves for them
    if choices > 1 and blocks > backend.num_kv_blocks:
        raise APIError(400, f"n={choices} choices of a {n}-token {where} need {blocks} KV blocks at once; this "
                       f"server holds {backend.num_kv_blocks}. Lower n or shorten the {where}.",
                       param="n", code="invalid_value")
    stop_ids = req.stop_token_ids or []
    if any(t >= backend.vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {backend.vocab_size})", param="stop_token_ids",
                       code="invalid_value")
    if chat:  # logprobs: true; top_logprobs: k (0 when unset)
        top, echo = (req.top_logprobs or 0) if req.logprobs else None, False
    else:
        top, echo = req.logprobs, bool(req.echo)
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0), seed=req.seed, max_tokens=max_tokens,
        stop=list(req.stop or []), stop_token_ids=list(stop_ids), ignore_eos=req.ignore_eos,
        logprobs=top, prompt_logprobs=top if echo else None,
    )
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    prompt_text = ""
    if echo:
        prompt_text = req.prompt if isinstance(req.prompt, str) else (
            backend.tokenizer.decode(ids) if backend.tokenizer is not None else "")
    return Job(chat=chat, model=model_name, prompt_token_ids=ids, sampling=sampling,
               stream=bool(req.stream), include_usage=include_usage, n=choices, echo=echo,
               logprobs=top, prompt_text=prompt_text, tokenizer=backend.tokenizer,
               return_token_ids=bool(req.return_token_ids))
