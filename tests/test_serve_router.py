"""The router: same API, forwards to instances (round robin), streams through, and maps
backend failures to 502/503 with OpenAI-style bodies."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from serve_fixtures import KEY, MODEL, PROMPTS, N

from pdflow.serve.router import create_router
from pdflow.serve.router_policy import RoundRobin
from pdflow.serve.server import ServerThread


def dead_url() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def router(backends, **kwargs):
    with ServerThread(create_router(backends, **kwargs)) as server:
        yield server.url


def broken_backend() -> FastAPI:
    """Answers 500 to completions, and cuts chat streams after one chunk."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def fail():
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    @app.post("/v1/chat/completions")
    async def cut():
        async def chunks():
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            raise RuntimeError("backend died mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_round_robin_rotates_the_start():
    rr = RoundRobin(["a", "b", "c"])
    assert [rr.pick()[0] for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick() == ["b", "c", "a"]
    with pytest.raises(ValueError):
        RoundRobin([])


def test_openai_client_through_the_router_matches_the_instance(tiny_server):
    with router([tiny_server.url]) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        want = tiny_server.oracle[PROMPTS[0]].text
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert r.choices[0].text == want
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks) == want
        assert [m.id for m in client.models.list().data] == [MODEL]
        # A backend's 4xx passes through as it is.
        direct = httpx.post(tiny_server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
        routed = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
        assert (routed.status_code, routed.json()) == (400, direct.json())


def test_unreachable_backend_is_skipped_then_503_when_none_answers(tiny_server):
    dead = dead_url()
    with router([dead, tiny_server.url]) as url:
        for _ in range(2):  # whichever comes first, the live one answers
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
            assert r.status_code == 200
        assert httpx.get(url + "/health").json()["backends"][dead] == "ConnectError"
        assert f'backend="{dead}",outcome="unreachable"' in httpx.get(url + "/metrics").text
    with router([dead]) as url:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_backend" and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(url + "/health").status_code == 503


def test_backend_failures_become_502():
    with ServerThread(broken_backend()) as broken, router([broken.url]) as url:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "backend_error"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "backend_error"


def unavailable_backend() -> FastAPI:
    """Answers 503 without Retry-After, as an instance whose engine is down does."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def down():
        return JSONResponse({"error": {"message": "engine is not running: boom", "type": "service_unavailable",
                                       "param": None, "code": "engine_down"}}, status_code=503)

    return app


def test_a_backends_own_503_passes_through_with_its_reason():
    """Not a 502 "bad gateway": the backend answered, and its reason is the client's."""
    with ServerThread(unavailable_backend()) as down, router([down.url]) as url:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 503 and "retry-after" not in r.headers
        assert r.json()["error"]["code"] == "engine_down"
        assert "engine is not running" in r.json()["error"]["message"]
        assert f'backend="{down.url}",outcome="unavailable"' in httpx.get(url + "/metrics").text


def test_router_key_and_backend_key(tiny_server):
    with router([tiny_server.keyed_url], api_key="sk-router", backend_api_key=KEY) as url:
        assert httpx.get(url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-router", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1


def test_disconnect_through_the_router_aborts_at_the_instance(tiny_server):
    def aborted() -> float:
        for line in httpx.get(tiny_server.url + "/metrics").text.splitlines():
            if line.startswith('pdflow_requests_total{outcome="abort"}'):
                return float(line.split()[-1])
        return 0.0

    before = aborted()
    body = {"model": MODEL, "prompt": "y" * 40, "max_tokens": 60, "ignore_eos": True, "stream": True}
    with router([tiny_server.url]) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body) as s:
            assert next(s.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 60
        while aborted() == before and time.monotonic() < deadline:
            time.sleep(0.2)
    assert aborted() == before + 1


def test_serve_spec_with_backends_is_a_router(tiny_server):
    from pdflow.serve.launch import serve_spec
    from pdflow.spec.load import compose_spec

    spec = compose_spec([f"serve.backends=[{tiny_server.url}]", "serve.port=0"])
    with serve_spec(spec) as served:
        assert served.backends == (tiny_server.url,)
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert r.choices[0].text == tiny_server.oracle[PROMPTS[0]].text
