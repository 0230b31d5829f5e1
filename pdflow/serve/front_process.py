"""An API front process: uvicorn on the listening socket the server bound, the OpenAI API
(``api.create_app``) over an ``EngineClient`` to the engine-core process.

It does HTTP, validation, tokenization, incremental detokenization and SSE; it holds no
engine state (admission, KV, metrics are the core's), so a killed front loses nothing
but its own connections, and the server starts another on the same socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

from pdflow.serve.engine_client import EngineClient


@dataclass(kw_only=True, slots=True, frozen=True)
class FrontOptions:
    model_name: str
    api_key: str | None
    request_timeout_s: float | None
    max_body_bytes: int
    log_level: str = "warning"


class RemoteHost:
    """What ``create_app`` serves, with the engine in the core process."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.loop = client  # open_stream, abort, healthy, error
        self.metrics = client  # count(outcome): the core keeps the metrics
        self.route_of = None  # a split server's engines serve every request whole

    @property
    def backend(self):
        if self.client.facts is None:
            from pdflow.serve.errors import APIError

            raise APIError(503, "the engine is starting; retry shortly", code="engine_starting", retry_after_s=1)
        return self.client.facts

    async def metrics_text(self) -> bytes:
        return (await self.client.query("metrics")).text


async def _say_ready(server, ready_fd: int) -> None:
    """One byte to the supervisor once uvicorn serves: this front has started."""
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        os.write(ready_fd, b"r")
    finally:
        os.close(ready_fd)


async def _serve(sock: socket.socket, ready_fd: int, address: str, front: int, core_pid: int,
                 options: FrontOptions) -> None:
    import uvicorn

    from pdflow.serve.api import create_app

    client = EngineClient(address, front=front, core_pid=core_pid)
    app = create_app(RemoteHost(client), model_name=options.model_name, api_key=options.api_key,
                     request_timeout_s=options.request_timeout_s, max_body_bytes=options.max_body_bytes)
    starting = asyncio.create_task(client.start())
    config = uvicorn.Config(app, log_level=options.log_level, access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    ready = asyncio.create_task(_say_ready(server, ready_fd))
    try:
        await server.serve(sockets=[sock])
    finally:
        ready.cancel()
        starting.cancel()
        client.close()


def front_main(fd: int, ready_fd: int, address: str, front: int, core_pid: int, parent_pid: int,
               options: FrontOptions) -> None:
    """Entry of a front process (spawned by ``supervisor``); SIGTERM ends it gracefully."""
    from pdflow.serve.core_process import watch_parent

    watch_parent(parent_pid)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = socket.socket(fileno=fd)  # the server's listening socket, shared by every front
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(sock, ready_fd, address, front, core_pid, options))


def _loop_factory():
    """uvloop where installed (a dependency off Windows): the front's per-token work is
    event-loop work; uvicorn picks httptools for parsing by itself."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
