"""Security of what pdflow exposes: loopback unless told otherwise, the API key on every
route but /health (instance and router, every route the apps declare, so a new route
cannot slip past), ``--api-key``, and the P/D side channel, which serves only the peers
that paired with it and survives garbage (real ZMQ and Mooncake on loopback)."""

from __future__ import annotations

import os
import random
import socket

import httpx
import pytest
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
    from pdflow.transfer import Endpoint

    endpoint = Endpoint()
    try:
        assert endpoint.address.startswith("tcp://127.0.0.1:")
    finally:
        endpoint.close()


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


# -- the P/D side channel ----------------------------------------------------------------------

transfer_kit = pytest.importorskip("transfer_kit")
transports = transfer_kit.transports
one_torch_thread = transfer_kit.one_torch_thread
OVERRIDES = ["prefill=tp1", "decode=tp1", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
             "transfer.staging_mib=16", "transfer.timeout_s=3", "transfer.retry_backoff_s=0.05"]


@transfer_kit.needs_mooncake
def test_the_side_channel_serves_only_paired_peers_and_survives_garbage(graph_of, transports):
    """Forged wants (unpaired instance, wrong pairing nonce, another reply address) are
    refused and write nothing; a thousand random and mutated frames are dropped; the real
    peer is served after all of it."""
    import msgspec
    import torch
    import zmq

    from pdflow.transfer import Endpoint, KVDone
    from pdflow.transfer.messages import encode

    graph = graph_of(*OVERRIDES)
    rig = transfer_kit.Rig(graph, 6, transports)
    rig.producer.blocks_of = lambda request_id: rig.blocks.get(request_id, [0])
    stranger = Endpoint()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        rig.pair()
        importer, producer = rig.importers[0], rig.producer_address(0)
        real = importer.expect("real", [2])[0]
        importer.cancel("real")
        forged = {
            "unpaired instance": msgspec.structs.replace(real, request_id="f1", instance="intruder",
                                                         reply_to=stranger.address),
            "wrong pairing": msgspec.structs.replace(real, request_id="f2", pairing=real.pairing ^ 1,
                                                     reply_to=stranger.address),
            "other reply address": msgspec.structs.replace(real, request_id="f3", reply_to=stranger.address),
        }
        for want in forged.values():
            stranger.send(producer, want)
        answers = {m.request_id: m for m in iter(lambda: stranger.recv(5.0), None)}
        assert sorted(answers) == ["f1", "f2", "f3"], answers
        assert all(isinstance(a, KVDone) and not a.ok for a in answers.values())
        assert "has not paired" in answers["f1"].error and "paired consumer" in answers["f2"].error
        assert all(torch.all(c.view(torch.uint8) == transfer_kit.POISON) for c in rig.consumer_caches[0].values())

        raw.connect(producer)
        rng = random.Random(0)
        frame = encode(forged["wrong pairing"])
        for i in range(1000):
            if i % 2:
                raw.send(rng.randbytes(rng.randrange(0, 512)))
            else:
                mutated = bytearray(frame)
                for _ in range(rng.randrange(1, 4)):
                    mutated[rng.randrange(len(mutated))] = rng.randrange(256)
                raw.send(bytes(mutated))
        host, port = producer.removeprefix("tcp://").split(":")
        with socket.create_connection((host, int(port))) as s:  # not even ZMQ
            s.sendall(rng.randbytes(4096))
        outcomes = rig.move({"after": ([1], [3])})
        assert [o.ok for o in outcomes.values()] == [True], outcomes
        assert rig.producer.endpoints[0].rejected > 0
    finally:
        raw.close()
        ctx.term()
        stranger.close()
        rig.close()
