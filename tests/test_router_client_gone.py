"""A client that leaves the router before its backend answered closes the router's
upstream request too, so the backend (a decode instance waiting on a prefill's transfer,
say) aborts instead of running the request for nobody. The backend here holds every
request until its connection ends, and reports that it saw the end."""

from __future__ import annotations

import json
import queue
import socket

import httpx
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


def test_a_backend_that_outlasts_the_request_timeout_ends_with_503_and_the_upstream_closed():
    """``serve.request_timeout_s`` reaches the router: a backend that holds a request (it
    does not enforce the timeout itself) gets twice that, then the client has a 503
    ``request_timeout`` and the backend sees its request's connection end. Without it the
    router would wait ``UPSTREAM_STALL_S`` (600 s)."""
    from pdflow.serve.router import UPSTREAM_STALL_S, upstream_timeout_s

    assert upstream_timeout_s(None) == UPSTREAM_STALL_S and upstream_timeout_s(0.5) == 1.0
    seen: queue.Queue = queue.Queue()
    with (ServerThread(holding_backend(seen)) as backend,
          ServerThread(create_router([backend.url], request_timeout_s=0.5)) as router):
        answer = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                            timeout=60)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "request_timeout"
        assert seen.get(timeout=30) == "started"
        assert seen.get(timeout=30) == "http.disconnect"
        metrics = httpx.get(router.url + "/metrics", timeout=30).text
        assert f'pdflow_router_requests_total{{backend="{backend.url}",outcome="timed_out"}} 1.0' in metrics
