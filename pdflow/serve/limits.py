"""A cap on request body size, for the instance API and the router alike.

A body over the cap is refused with 413 before it is buffered: at once when its
``Content-Length`` says so, or as soon as a chunked body passes the cap while the handler
reads it. Without a cap, one client could make the server hold any amount of memory.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdflow.serve.errors import APIError, error_body

DEFAULT_MAX_BODY_BYTES = 8 << 20


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


class BodyLimit:
    """ASGI middleware: ``app.add_middleware(BodyLimit, max_bytes=...)``. The handler's
    own error handlers answer a chunked body that runs over (an ``APIError``)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            refusal = self._check_declared(declared)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, limited, send)

    def _check_declared(self, declared: bytes) -> JSONResponse | None:
        try:
            size = int(declared)
        except ValueError:
            size = -1
        if size < 0:
            return JSONResponse(error_body(400, "Content-Length must be a non-negative integer.",
                                           code="invalid_request"), status_code=400)
        if size > self.max_bytes:
            return too_large(self.max_bytes).response()
        return None
