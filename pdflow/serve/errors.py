"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Clients (the official SDK included) read ``error.message`` and map the status to an
exception class, so every refusal, from bad JSON to a dead engine, uses this shape.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         413: "invalid_request_error", 500: "internal_error", 502: "bad_gateway", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        # Sent as ``Retry-After``: when a refused (overloaded) request is worth trying again.
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _param(loc: tuple) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path."""
    err = exc.errors(include_url=False)[0]
    kind, loc = err["type"], tuple(err["loc"])
    param = _param(loc)
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {err['msg']}",
                        code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    if kind.endswith("_type") or kind in ("model_type", "dict_type", "list_type", "literal_error"):
        code = "invalid_value" if kind == "literal_error" else "invalid_type"
        return APIError(400, f"Invalid type or value for '{param}': {err['msg']}.", param=param, code=code)
    message = err["msg"].removeprefix("Value error, ")
    where = f" for '{param}'" if param else ""
    return APIError(400, f"Invalid value{where}: {message}", param=param, code="invalid_value")
