"""Security of what pdflow exposes: loopback unless told otherwise, the API key on every
route but /health (instance and router, every route the apps declare, so a new route
cannot slip past), ``--api-key``, and the P/D side channel, which serves only the peers
that paired with it and survives garbage (real ZMQ and Mooncake on loopback)."""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from fastapi.routing import APIRoute
from serve_fixtures import KEY, MODEL

from pdflow.serve.api import create_app
from pdflow.serve.router import create_router
from pdflow.serve.server import ServerThread


def test_everything_binds_loopback_by_default():
    from pdflow.spec.load import compose_spec

    assert compose_spec([]).serve.host == "127.0.0.1"
    with ServerThread(create_router(["http://127.0.0.1:9"])) as server:
        assert server.sock.getsockname()[0] == "127.0.0.1"
    from pdflow.graph import build_graph
    from pdflow.transfer.p2p import P2PListener

    graph = build_graph(compose_spec(["transfer=nccl", "prefill=tp1", "decode=tp1"]))
    caches = {u.name: torch.zeros(u.cache_shape(2)) for u in graph.consumer.ranks[0].units}
    listener = P2PListener(graph=graph, rank=0, caches=caches, spec=graph.spec.transfer)
    try:
        assert listener.address.startswith("127.0.0.1:")
    finally:
        listener.close()


def _calls(app) -> list[tuple[str, str]]:
    """(method, concrete path) of every route the app declares."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            path = route.path.replace("{name:path}", MODEL).replace("{name}", MODEL)
            out += [(method, path) for method in sorted(route.methods)]
    return out


@pytest.mark.parametrize("kind", ["instance", "router"])
def test_the_api_key_guards_every_route_but_health(tiny_server, kind):
    if kind == "instance":
        app = create_app(tiny_server.host, model_name=MODEL, api_key=KEY)
    else:
        app = create_router([tiny_server.keyed_url], api_key="sk-router", backend_api_key=KEY)
    key = KEY if kind == "instance" else "sk-router"
    calls = _calls(app)
    assert {("GET", "/health"), ("GET", "/openapi.json"), ("POST", "/v1/completions")} <= set(calls)
    with ServerThread(app) as server:
        for method, path in calls:
            body = None if method != "POST" else {"model": MODEL, "max_tokens": 1} | (
                {"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a"})
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"},
                            {"Authorization": f"Bearer {key}x"}):
                r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
                if path == "/health":
                    assert r.status_code == 200
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.request(method, server.url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                              timeout=30)
            assert r.status_code == 200, (method, path, r.text)


def test_api_key_flag_goes_to_the_environment_not_to_hydra(monkeypatch):
    from pdflow.cli import take_api_key
    from pdflow.serve.launch import api_key_of
    from pdflow.spec.load import compose_spec

    # Set, then delete: monkeypatch then restores the variable's absence after the test
    # (a bare delenv of an unset variable records nothing, and the key would leak into
    # every later test of the session).
    monkeypatch.setenv("PDFLOW_API_KEY", "")
    monkeypatch.delenv("PDFLOW_API_KEY")
    assert take_api_key(["serve.port=0", "--api-key", "sk-a,b=${c}'"]) == ["serve.port=0"]
    assert api_key_of(compose_spec([])) == "sk-a,b=${c}'"
    assert take_api_key(["--api-key=sk-2"]) == [] and os.environ["PDFLOW_API_KEY"] == "sk-2"
    with pytest.raises(ValueError, match="needs a key"):
        take_api_key(["--api-key"])
