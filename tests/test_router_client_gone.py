"""A client that leaves the router before its backend answered closes the router's
upstream request too, so the backend (a decode instance waiting on a prefill's transfer,
say) aborts instead of running the request for nobody. The backend here holds every
request until its connection ends, and reports that it saw the end."""

from __future__ import annotations

import json
import queue
import socket

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdflow.serve.router import create_router
from pdflow.serve.server import ServerThread


def holding_backend(seen: queue.Queue) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def hold(request: Request):
        await request.body()
        seen.put("started")
        message = await request.receive()  # the body is read: only the connection's end comes
        seen.put(message["type"])
        return Response("{}", media_type="application/json")

    return app


def test_a_client_gone_before_the_answer_closes_the_upstream_request():
    seen: queue.Queue = queue.Queue()
    with ServerThread(holding_backend(seen)) as backend, ServerThread(create_router([backend.url])) as router:
        host, port = router.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert seen.get(timeout=30) == "started"
        assert seen.get(timeout=30) == "http.disconnect"  # queue.Empty here: the upstream stayed open
