"""Bring up what a run spec serves, behind the HTTP API, as a context manager.

By ``serve.role``: the spec's deployment (``pdflow.Deployment``: a prefill instance
writing each prompt's KV into a decode instance, or with ``mode=monolithic`` the decode
instance alone) driven from an engine-core process, ``serve.api_servers`` API front
processes before it (``supervisor``); or one instance
of the run graph (``prefill``, ``decode``: ``pd_instance``); or a router, over given
instance URLs (``serve.backends``) or pairing ``serve.prefill`` with ``serve.decode``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdflow.spec import RunSpec

API_KEY_ENV = "PDFLOW_API_KEY"


@dataclass(kw_only=True, slots=True, frozen=True)
class Served:
    """Where a launched API answers: ``url`` (no trailing /v1) and how to call it."""

    url: str
    model_name: str
    api_key: str | None
    # Backend URLs when this is a router; empty for an instance.
    backends: tuple[str, ...] = ()
    # Why the server cannot serve any more (its engine-core process died), else None.
    failure: Callable[[], str | None] = lambda: None


def api_key_of(spec: RunSpec) -> str | None:
    return spec.serve.api_key or os.environ.get(API_KEY_ENV) or None


def model_name_of(spec: RunSpec) -> str:
    return spec.serve.model_name or spec.model.name


def _split_server(spec: RunSpec, stack: contextlib.ExitStack, port: int, key: str | None, name: str) -> Served:
    """The deployment in an engine-core process, ``serve.api_servers`` API fronts before it."""
    from pdflow.serve.front_process import FrontOptions
    from pdflow.serve.supervisor import Supervisor

    options = FrontOptions(model_name=name, api_key=key, request_timeout_s=spec.serve.request_timeout_s,
                           max_body_bytes=spec.serve.max_body_bytes)
    supervisor = Supervisor(spec, host=spec.serve.host, port=port, options=options)
    stack.callback(supervisor.stop)
    supervisor.start().wait_ready(spec.serve.ready_timeout_s)
    return Served(url=supervisor.url, model_name=name, api_key=key, failure=lambda: supervisor.failure)


@contextlib.contextmanager
def serve_spec(spec: RunSpec, *, port: int | None = None) -> Iterator[Served]:
    """An instance (or, with ``serve.backends``, a router) answering on ``serve.host``;
    ``port`` overrides ``serve.port`` (0: a free one). Everything stops on exit."""
    from pdflow.serve.server import ServerThread, wait_healthy

    port = spec.serve.port if port is None else port
    key, name = api_key_of(spec), model_name_of(spec)
    with contextlib.ExitStack() as stack:
        role = spec.serve.role
        if role in ("prefill", "decode"):
            from pdflow.serve.pd_instance import instance_app

            app = instance_app(spec, stack, api_key=key, model_name=name)
        elif role == "router":
            from pdflow.serve.pd_instance import check_instances
            from pdflow.serve.router import create_router

            check_instances(list(spec.serve.prefill), list(spec.serve.decode), api_key=key,
                            timeout=spec.serve.ready_timeout_s)
            app = create_router(list(spec.serve.decode), api_key=key, prefill=list(spec.serve.prefill),
                                max_body_bytes=spec.serve.max_body_bytes, router=spec.router,
                                block_tokens=spec.decode.block_size,
                                request_timeout_s=spec.serve.request_timeout_s)
        elif spec.serve.backends:
            from pdflow.serve.router import create_router

            app = create_router(list(spec.serve.backends), api_key=key, max_body_bytes=spec.serve.max_body_bytes,
                                request_timeout_s=spec.serve.request_timeout_s)
        else:
            yield _split_server(spec, stack, port, key, name)
            return
        server = stack.enter_context(ServerThread(app, host=spec.serve.host, port=port))
        wait_healthy(server.url, timeout=spec.serve.ready_timeout_s)
        backends = spec.serve.decode if role == "router" else spec.serve.backends
        yield Served(url=server.url, model_name=name, api_key=key, backends=tuple(backends))
