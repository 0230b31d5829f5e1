"""The engine-core process: a busy loop owning the deployment, fed over ZMQ by API fronts.

Why a process: the engine step must not share an interpreter lock with HTTP parsing,
JSON, SSE and detokenization (issue 30: at 64 streams a thread of the uvicorn process
could not keep a 2.5 ms decode step fed). The loop, one thread: take every message the
fronts sent (not waiting while anything runs), admit, step, and send each front one
``Steps`` message with all of its requests' new token ids. Admission lives here, so KV
reservations stay right however many fronts there are. The metrics live here too (latencies
observed as tokens leave the engine, outcomes reported by the fronts), so any front's
/metrics answers for all of them. The process owns its deployment's rank processes
(their zygote exits when this process does, and its ranks with it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import defaultdict

import zmq

from pdflow.serve.core_wire import (
    Abort,
    Facts,
    Hello,
    Outcome,
    Query,
    Reply,
    Steps,
    Submit,
    core_decoder,
    encode,
    to_delta,
)
from pdflow.serve.engine_threads import set_engine_threads
from pdflow.serve.reuse_metrics import ReuseCollector
from pdflow.serve.serving_core import ServingCore, StreamEvent, Ticket

log = logging.getLogger(__name__)
IDLE_POLL_MS = 50


class CoreServer:
    """One ``ServingCore`` behind a ROUTER socket; fronts are DEALERs named ``front-<i>``."""

    def __init__(self, core: ServingCore, metrics, facts: Facts, sock: zmq.Socket):
        self.core, self.metrics, self.facts, self.sock = core, metrics, facts, sock
        self.tickets: dict[tuple[bytes, str], Ticket] = {}
        self.outbox: dict[bytes, list] = defaultdict(list)
        self.stopping = threading.Event()

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopping.is_set():
            if poller.poll(0 if self.core.busy else IDLE_POLL_MS):
                self._take_messages()
            self.core.turn()
            self._flush()

    def shut(self, reason: str, status: int) -> None:
        self.core.fail_all(reason, status)
        self._flush()

    # -- messages in ---------------------------------------------------------------------

    def _take_messages(self) -> None:
        while True:
            try:
                front, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(front, core_decoder.decode(payload))

    def _handle(self, front: bytes, msg) -> None:
        if isinstance(msg, Submit):
            ticket = Ticket(prompt_token_ids=msg.prompt_token_ids, sampling=msg.sampling,
                            deliver=self._deliverer(front, msg.rid))
            self.tickets[(front, msg.rid)] = ticket
            self.core.offer(ticket)
        elif isinstance(msg, Abort):
            ticket = self.tickets.get((front, msg.rid))
            if ticket is not None:
                self.core.cancel(ticket)
                self.tickets.pop((front, msg.rid), None)
        elif isinstance(msg, Outcome):
            self.metrics.count(msg.outcome)
        elif isinstance(msg, Query):
            text = self.metrics.render() if msg.what == "metrics" else b""
            self._send(front, Reply(qid=msg.qid, facts=self.facts, text=text))
        elif isinstance(msg, Hello):  # a restarted front: its predecessor's requests have no reader
            for key in [k for k in self.tickets if k[0] == front]:
                self.core.cancel(self.tickets.pop(key))

    def _deliverer(self, front: bytes, rid: str):
        def deliver(event: StreamEvent) -> None:
            self.outbox[front].append(to_delta(rid, event))
            if event.done:
                self.tickets.pop((front, rid), None)

        return deliver

    # -- messages out --------------------------------------------------------------------

    def _flush(self) -> None:
        for front, deltas in self.outbox.items():
            if deltas:
                self._send(front, Steps(deltas=deltas))
        self.outbox.clear()

    def _send(self, front: bytes, msg) -> None:
        try:
            self.sock.send_multipart([front, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:  # not with an unlimited queue; said rather than lost silently
            log.error("could not queue a message to %s", front.decode(errors="replace"))


def watch_parent(parent_pid: int) -> None:
    """Exit when the server process is gone (killed): no orphaned engine, no orphaned ranks."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pdflow-watch-parent", daemon=True).start()


def core_main(spec, address: str, parent_pid: int) -> None:
    """Entry of the engine-core process (spawned by ``supervisor``). SIGTERM: fail what is
    running with 503, stop the ranks, exit 0; a broken engine exits 1 (the server follows)."""
    watch_parent(parent_pid)
    from pdflow.engine.deployment import Deployment
    from pdflow.serve.admission import policy_of
    from pdflow.serve.backend import LLMBackend
    from pdflow.serve.metrics import ServeMetrics

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    # No high-water mark: a ROUTER drops what it cannot queue, and a dropped ``Steps`` would
    # leave its requests' streams waiting forever. What a front has not read yet is queued
    # here until it reads or its connection goes (it exited).
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    set_engine_threads(spec.serve)
    deployment = Deployment(spec)
    for engine in (deployment.producer, deployment.consumer):
        if engine is not None:
            engine.detokenizer.stream_text = False  # the fronts make text from the ids
    backend = LLMBackend(deployment)
    folder = deployment.engine.instance.folder if backend.tokenizer is not None else None
    facts = Facts(max_model_len=backend.max_model_len, vocab_size=backend.vocab_size, block_size=backend.block_size,
                  num_kv_blocks=backend.num_kv_blocks, tokenizer_folder=None if folder is None else str(folder))
    metrics = ServeMetrics(backend, num_active=lambda: len(core.active))  # read at a scrape, once core is set
    producer = deployment.producer
    if producer is not None:  # P/D in this process: prefix-reuse counters of both sides, KV moved
        metrics.registry.register(ReuseCollector(producer=producer, consumer=deployment.consumer,
                                                 counts=deployment.reuse))
        metrics.count_kv_transfer(lambda: (producer.kv_bytes_sent, producer.kv_blocks_sent))
    core = ServingCore(backend, on_token=metrics.on_token, on_finish=metrics.on_finish, on_step=metrics.on_step,
                       admission=policy_of(spec.serve))
    server = CoreServer(core, metrics, facts, sock)
    signal.signal(signal.SIGTERM, lambda *_: server.stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    outcome = {"code": 1}
    # The loop runs on a thread of its own, as the in-process engine loop did: torch's CPU
    # thread pool stepped from the main thread ran ~50x slower on an oversubscribed host
    # (bench_serve --front split, 2 loaded cores; see bench/RESULTS.md).
    loop = threading.Thread(target=_run, args=(server, backend, sock, outcome), name="pdflow-engine-core")
    loop.start()
    while loop.is_alive():
        loop.join(0.5)  # the main thread stays free for SIGTERM
    os._exit(outcome["code"])


def _run(server: CoreServer, backend, sock, outcome: dict) -> None:
    try:
        server.serve()
        server.shut("server is shutting down", 503)
        outcome["code"] = 0
    except Exception as exc:  # a dead engine: its requests end with an error, then the server exits
        log.exception("engine core failed")
        server.shut(f"engine failed: {type(exc).__name__}: {exc}", 503)
    finally:
        backend.shutdown()
        sock.close(linger=1000)
