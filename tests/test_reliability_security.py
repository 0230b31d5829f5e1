"""Security of what pdflow exposes: loopback unless told otherwise, the API key on every
route but /health (instance and router, every route the apps declare, so a new route
cannot slip past), ``--api-key``, and the served P/D pairs (``transfer.grants``): a
consumer rank's listener refuses a hello without its pairing token and a transfer whose
nonce does not grant the blocks it names, writes nothing for either, survives garbage,
and serves the real producer after all of it (real sockets: Gloo, Mooncake TCP on
loopback)."""

from __future__ import annotations

import os
import random
import socket
import time

import httpx
import pytest
import torch
from fastapi.routing import APIRoute
from serve_fixtures import KEY, MODEL

from pdflow.serve.api import create_app
from pdflow.serve.router import create_router
from pdflow.serve.server import ServerThread
from pdflow.transfer.errors import TransferError
from pdflow.transfer.p2p import P2PListener, P2PPeer


def test_everything_binds_loopback_by_default():
    from pdflow.spec.load import compose_spec

    assert compose_spec([]).serve.host == "127.0.0.1"
    with ServerThread(create_router(["http://127.0.0.1:9"])) as server:
        assert server.sock.getsockname()[0] == "127.0.0.1"
    from pdflow.graph import build_graph

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


# -- the served P/D pairs ----------------------------------------------------------------------

transfer_kit = pytest.importorskip("transfer_kit")
one_torch_thread = transfer_kit.one_torch_thread
transports = transfer_kit.transports
PAIR = ["prefill=tp1", "decode=tp1", "drafter=none", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.block_size=32", "decode.block_size=32", "transfer.timeout_s=5"]
MOVERS = ["nccl", pytest.param("mooncake_tcp", marks=transfer_kit.needs_mooncake)]


class OnePair:
    """Consumer rank 0's listener (keyed with ``transfer_kit.KEY``, poisoned caches) and
    producer rank 0's caches: a pair is made per test, with whatever token it presents."""

    def __init__(self, graph, transports):
        self.graph, self.spec = graph, graph.spec.transfer
        mooncake = self.spec.backend == "mooncake"
        self.cut = graph.cut(0, 0)
        self.consumer = transfer_kit.caches_for(graph.consumer.ranks[0].units, 4, fill="poison")
        self.producer = transfer_kit.producer_caches_of(graph, 4)[0]
        self.listener = P2PListener(graph=graph, rank=0, caches=self.consumer, spec=self.spec,
                                    transport=transports(self.spec) if mooncake else None, key=transfer_kit.KEY)
        self.producer_transport = transports(self.spec) if mooncake else None

    def peer(self, pairing: str) -> P2PPeer:
        return P2PPeer(pairing=pairing, address=self.listener.address, consumer_device="cpu",
                       plan=self.cut.over(set(self.producer)), caches=self.producer,
                       dst_block_bytes={u.name: u.bytes_per_block for u in self.graph.consumer.ranks[0].units},
                       producer_rank=0, spec=self.spec, transport=self.producer_transport)

    def untouched(self) -> bool:
        return all(torch.all(c.view(torch.uint8) == transfer_kit.POISON) for c in self.consumer.values())

    def landed_exactly(self, src, dst) -> bool:
        return transfer_kit.wrong_units(self.graph, {0: self.producer}, {0: self.consumer}, [(src, dst)]) == []

    def real_producer_lands(self) -> bool:
        """Pair with the real token, send blocks [1, 3] into [2, 0]: whether they landed exactly."""
        peer = self.peer(transfer_kit.PAIRING)
        try:
            transfer_kit.send(peer, [1, 3], [2, 0])
            return self.landed_exactly([1, 3], [2, 0])
        finally:
            peer.close()


@pytest.mark.parametrize("transfer", MOVERS)
def test_a_listener_refuses_a_hello_without_its_pairing_token(graph_of, transports, transfer):
    """A producer that did not learn the consumer's endpoint (no token, another consumer's,
    a guess) is refused at its hello, with the reason, and is given nothing: no session, no
    buffer, no byte in the caches. The real token pairs and lands."""
    from pdflow.transfer.grants import new_key, pairing_token

    pair = OnePair(graph_of(*PAIR, f"transfer={transfer}"), transports)
    try:
        for token in ("", pairing_token(new_key()), transfer_kit.PAIRING[:-1] + "0"):
            with pytest.raises(TransferError, match="unknown hello"):
                pair.peer(token)
        # A refused connection's session ends on its own thread just after the refusal is
        # sent: wait for it (bounded), then nothing of it may remain.
        deadline = time.monotonic() + 10
        while pair.listener._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pair.untouched() and pair.listener._sessions == []
        assert pair.real_producer_lands()
    finally:
        pair.listener.close()


@pytest.mark.parametrize("transfer", MOVERS)
def test_a_transfer_with_the_wrong_nonce_is_refused_and_writes_nothing(graph_of, transports, transfer):
    """A paired producer's request whose nonce does not grant the blocks it names (a flipped
    bit, another grant's nonce, the right blocks in another order) is refused by the
    consumer rank before it scatters: the caches keep their poison, the pair serves on, and
    the granted request lands."""
    from pdflow.transfer.grants import kv_nonce

    pair = OnePair(graph_of(*PAIR, f"transfer={transfer}"), transports)
    peer = pair.peer(transfer_kit.PAIRING)
    try:
        granted = kv_nonce(transfer_kit.KEY, [2, 0])
        for dst, nonce in (([2, 0], granted ^ 1), ([1, 3], granted), ([0, 2], granted)):
            with pytest.raises(TransferError, match="nonce does not grant"):
                peer.send([1, 3], dst, "forged", nonce)
        assert pair.untouched() and pair.listener.landed == 0 and not peer.broken
        peer.send([1, 3], [2, 0], "granted", granted)
        assert pair.landed_exactly([1, 3], [2, 0]) and pair.listener.landed == 1
    finally:
        peer.close()
        pair.listener.close()


def test_a_listener_survives_garbage_and_serves_the_real_producer(graph_of, transports):
    """Random bytes, oversized lengths and mutated hellos and requests on the listener's port:
    each connection is dropped (nothing written), the listener keeps accepting, and the
    real producer pairs and lands after all of it."""
    from msgspec.msgpack import encode

    from pdflow.transfer.p2p_messages import P2PHello, P2PRequest

    pair = OnePair(graph_of(*PAIR, "transfer=nccl"), transports)
    host, port = pair.listener.address.rsplit(":", 1)
    rng = random.Random(0)
    hello = encode(P2PHello(producer_rank=0, units=sorted(pair.producer), mover="gloo", pairing="x" * 64))
    request = encode(P2PRequest(request_id="r", dst_blocks=[0, 1], nonce=1))
    frames = [rng.randbytes(rng.randrange(0, 256)) for _ in range(40)]
    frames += [(1 << 31).to_bytes(4, "big") + b"x"]  # a length over the frame limit
    for frame in (hello, request):
        for _ in range(30):
            mutated = bytearray(frame)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            frames.append(len(mutated).to_bytes(4, "big") + bytes(mutated))
    try:
        for frame in frames:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(frame)
        assert pair.real_producer_lands()
    finally:
        pair.listener.close()


@pytest.mark.slow
def test_a_deployment_whose_grant_is_wrong_fails_the_request_and_frees_its_blocks(monkeypatch):
    """Through the engine: a producer handed a nonce the consumer's owner did not make
    (here the owner's grant is altered) has its transfer refused by the consumer rank;
    the request ends with that error, every block of both pools comes back, and the next
    request (granted) is served."""
    from pdflow import Deployment, SamplingParams, compose
    from pdflow.engine.instance import Instance

    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with Deployment(compose([*PAIR, "transfer=nccl", "prefill.num_kv_blocks=8", "decode.num_kv_blocks=8"])) as d:
        real = Instance.kv_nonce
        monkeypatch.setattr(Instance, "kv_nonce", lambda self, blocks: real(self, blocks) ^ 1)
        [out] = d.generate([[5, 6, 7, 8, 9]], greedy)
        assert out.error is not None and "nonce does not grant" in out.error, out
        assert all(e.num_free_kv_blocks == e.num_kv_blocks for e in (d.producer, d.consumer))
        monkeypatch.setattr(Instance, "kv_nonce", real)
        [out] = d.generate([[5, 6, 7, 8, 9]], greedy)
        assert out.error is None and len(out.token_ids) == 3
