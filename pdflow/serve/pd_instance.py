"""One side of a P/D run graph as its own server (``instance_app``: the producer or the
consumer, with its own ranks, behind the OpenAI API and the ``/pdflow/`` routes), and
what a P/D router checks before it serves (``check_instances``): every instance healthy,
of the role it was given as, and all of one run graph.
"""

from __future__ import annotations

import contextlib

import httpx
import msgspec

from pdflow.graph import CONSUMER, PRODUCER
from pdflow.serve.pd_wire import INSTANCE_PATH, InstanceCard, RunGraphMismatch, check_same_graph, fingerprint
from pdflow.spec import RunSpec
from pdflow.spec.errors import ConfigError

EXCHANGE_TIMEOUT_S = 600.0


def instance_app(spec: RunSpec, stack: contextlib.ExitStack, *, api_key: str | None, model_name: str):
    """The app of this process's instance; its engine stops when ``stack`` closes."""
    from pdflow.engine.instance import Instance
    from pdflow.engine.llm_engine import LLMEngine
    from pdflow.serve.admission import policy_of
    from pdflow.serve.api import EngineHost, create_app
    from pdflow.serve.engine_threads import set_engine_threads

    role = spec.serve.role
    if spec.mode != "pd":
        raise ConfigError(f"serve.role={role} serves one side of a P/D run graph, but mode={spec.mode}; "
                          "use mode=pd (or serve.role=deployment for a monolithic instance)")
    set_engine_threads(spec.serve)  # the engine loop's step shares the host with this process's API thread
    engine = LLMEngine(Instance(spec, role))  # serve.role names the graph's side: prefill or decode
    stack.callback(engine.shutdown)  # also when the backend below fails to start
    print_ = fingerprint(spec)
    card = InstanceCard(role=role, model=model_name, fingerprint=print_, max_model_len=engine.max_model_len)
    if role == PRODUCER:
        from pdflow.serve.pd_prefill import PrefillBackend
        from pdflow.serve.pd_prefill import add_prefill_routes as add_routes

        backend, route_of = PrefillBackend(engine), None  # its API serves requests whole
        # An export that settles ends the loop's wait: its answer goes out at once, not on
        # the next poll (an in-process rank's sender calls it; ranks of their own, a watch
        # on their pipes).
        engine.executor.on_settled(backend.wake)
    else:
        from pdflow.serve.pd_decode import DecodeBackend, prefill_route
        from pdflow.serve.pd_decode import add_decode_routes as add_routes

        backend = DecodeBackend(engine, fingerprint=print_, api_key=api_key, timeout_s=EXCHANGE_TIMEOUT_S)
        stack.callback(backend.shutdown)
        route_of = prefill_route  # the router's x-pdflow-prefill header
    host = EngineHost(backend, admission=policy_of(spec.serve), route_of=route_of)
    host.start()
    stack.callback(host.stop)
    app = create_app(host, model_name=model_name, api_key=api_key, request_timeout_s=spec.serve.request_timeout_s,
                     max_body_bytes=spec.serve.max_body_bytes)
    add_routes(app, host, card, api_key=api_key)
    return app


def check_instances(prefill: list[str], decode: list[str], *, api_key: str | None, timeout: float) -> None:
    """Refuse (``RunGraphMismatch``) instances of the wrong role or of different graphs."""
    from pdflow.serve.server import wait_healthy

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    cards = {}
    for urls, role in ((prefill, PRODUCER), (decode, CONSUMER)):
        for url in urls:
            wait_healthy(url.rstrip("/"), timeout=timeout)
            r = httpx.get(url.rstrip("/") + INSTANCE_PATH, headers=headers, timeout=10.0)
            if r.status_code != 200:
                raise RunGraphMismatch(f"{url} is not a pdflow P/D instance ({INSTANCE_PATH} answered "
                                       f"{r.status_code}); start it with `pdflow serve serve.role=prefill|decode`")
            card = msgspec.convert(r.json(), InstanceCard, strict=False, from_attributes=False)
            if card.role != role:
                raise RunGraphMismatch(f"{url} was given as a {role} instance but serves serve.role={card.role}")
            cards[url] = card
    check_same_graph(cards)
