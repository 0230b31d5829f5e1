"""The OpenAPI schema of the HTTP API, with the request bodies the handlers validate.

Handlers read their bodies themselves (to answer every mistake in the OpenAI error
shape), so FastAPI cannot see them; the schema gets them from the pydantic models here.
It is served at ``GET /openapi.json`` behind the same key as the other routes: clients
and fuzzers (tests/test_reliability_serve.py runs schemathesis against it) read it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, guard: list, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve the schema of ``app``; ``bodies`` maps a POST path to its request model."""

    def schema() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version="1", routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
                }
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = schema

    @app.get("/openapi.json", dependencies=guard, include_in_schema=False)
    async def openapi() -> dict:
        return schema()
