"""A producer instance served on its own (``pdflow serve serve.role=prefill``).

Its OpenAI API serves requests whole; its internal routes (``pd_wire``) take consumers'
pairing and remote prefills, which ride the same engine loop as API requests (their
ticket's ``PDRoute``). The ranks keep a peer table by consumer id: a consumer's first
prefill pairs its ranks (steps in flight are collected, nothing is drained). A consumer
that leaves (``/pdflow/unpair``) or whose transfer failed is forgotten once none of its
prefills is in the engine (a live one pairs again on its next prefill).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter, Gauge

from pdflow.engine.engine_facts import EngineFacts
from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.sequence import Sequence
from pdflow.parallel.messages import ForgetConsumer, KVEndpoint
from pdflow.serve.api import EngineHost, bearer_guard
from pdflow.serve.backend import DraftCounts, DraftStats
from pdflow.serve.errors import APIError
from pdflow.serve.pd_wire import (
    ABORT_PATH,
    INSTANCE_PATH,
    PAIR_PATH,
    PREFILL_PATH,
    UNPAIR_PATH,
    AbortPrefill,
    InstanceCard,
    PairRequest,
    PDRoute,
    PrefillAnswer,
    RemotePrefill,
    RouteRefused,
)
from pdflow.serve.reuse_metrics import ReuseCollector
from pdflow.serve.serving_core import Ticket
from pdflow.transfer.errors import PairingRefused

IDLE_SLEEP_S = 0.002
SETTLE_POLL_S = 0.005  # an aborted prefill's answer: how often its route looks for the export settled
EARLY_ABORT_KEEP_S = 60.0  # an abort that came before its prefill: how long it waits for it


class PrefillBackend(EngineFacts):
    """The producer's ``ServingBackend``: API requests whole, remote prefills into a
    paired consumer's blocks."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # Consumers' endpoints as they posted them, and those the ranks have paired with
        # (a consumer posting other endpoints is paired again on its next prefill).
        self.consumers: dict[str, list[KVEndpoint]] = {}
        self.paired: set[str] = set()
        self.pairings: dict[str, int] = {}  # ranks paired, per consumer id (/metrics)
        # Consumers whose peers the ranks hold now (replaced whole: routes read it). One
        # held but no longer paired with its posted endpoints (it left: /pdflow/unpair, a
        # transfer to it failed, it posted others) is forgotten once idle (``_let_go``).
        self.held: frozenset[str] = frozenset()
        # Outputs of the steps a pairing collected (``LLMEngine.pair``), for the next ``step``.
        self._collected: list[TokenOutput] = []
        self.remote: dict[str, str] = {}  # in the engine, answer not yet taken: its consumer id
        self.answers: dict[str, PrefillAnswer] = {}
        # Remote prefills by (consumer id, the consumer's request id): what /pdflow/abort ends.
        self.jobs: dict[tuple[str, str], Ticket] = {}
        # Aborts that came before their prefill (the consumer's threads raced): when, by key.
        self.early_aborts: dict[tuple[str, str], float] = {}
        # Aborted remote prefills whose step or export may still write (replaced whole on
        # the engine loop's thread: their routes read it).
        self.settling: dict[str, Sequence] = {}
        self.prefills = 0  # remote prefills whose KV landed (reported by /pdflow/instance)
        self._ids = itertools.count()
        self._draft_counts = DraftCounts()
        self._woken = threading.Event()

    # -- ServingBackend (the rest: EngineFacts) ----------------------------------------

    def add(self, prompt_token_ids: list[int], sampling: SamplingParams, *, route: PDRoute | None = None) -> str:
        if route is not None and route.remote is None:
            raise RouteRefused("a prefill instance prefills for consumers (PDRoute.remote); it sends no prompt "
                             "to another producer (PDRoute.prefill_at: a decode instance's)")
        rid = f"p{next(self._ids)}"
        if route is not None:
            self._add_remote(rid, route.remote, sampling)
        else:
            self.engine.add_request(list(prompt_token_ids), sampling, rid)
        return rid

    def abort(self, request_id: str) -> bool:
        if self.remote.pop(request_id, None) is None:
            return self.engine.abort(request_id)
        if (held := self.engine.drop(request_id)) is not None:  # answered once it settled (``step``)
            self.settling = {**self.settling, request_id: held}
        return True

    def step(self) -> list[TokenOutput]:
        self._let_go()
        stepped, self._collected = self._collected, []
        if self.engine.has_unfinished():
            # Never parked on an export: with no step in flight the loop looks for settled
            # ones and goes back for commands, so a consumer that stalls its transfer
            # holds up no other request, pairing or abort (engine.step would wait for it).
            busy = self.engine.submit()
            fresh = self._draft_counts.keep(self.engine.collect(wait=False))
            if not busy and not fresh:
                self._idle()
            stepped += fresh
        elif not stepped:
            self._idle()  # waiting for nothing but the next command
        if self.settling:
            self.settling = {rid: seq for rid, seq in self.settling.items() if seq.holds_blocks}
        for out in stepped:
            consumer = self.remote.pop(out.request_id, None)
            if consumer is not None:
                failed = out.kv_error
                self.answers[out.request_id] = PrefillAnswer(
                    first=out, error=failed and f"KV transfer failed: {failed}")
                self.prefills += failed is None
                if failed:  # a dead consumer's peers go; a live one pairs again on its next prefill
                    self.paired.discard(consumer)
        return stepped

    def wake(self) -> None:
        self._woken.set()

    def _idle(self) -> None:
        """Wait ``IDLE_SLEEP_S``, or until ``wake``: a command that came meanwhile (a
        prefill, an abort) or an export that settled (``pd_instance`` has the executor call
        ``wake``: ``Executor.on_settled``) is taken at once."""
        self._woken.wait(IDLE_SLEEP_S)
        self._woken.clear()  # a wake after the wait ended: the loop takes its commands next anyway

    def draft_stats(self, request_id: str) -> DraftStats | None:
        return self._draft_counts.pop(request_id)

    def shutdown(self) -> None:
        self.engine.shutdown()

    # -- consumers leaving --------------------------------------------------------------

    def unpair(self, consumer: str) -> None:
        """A consumer stops (the route's thread): drop its endpoints and its count;
        ``step``, on the engine loop's thread, forgets its ranks' peers."""
        self.consumers.pop(consumer, None)
        self.pairings.pop(consumer, None)

    def _let_go(self) -> None:
        """Forget the peers of the consumers held but not paired with their posted
        endpoints (gone, failed, or posting others) once none of their prefills is in the
        engine (exports to them settle first); one paired again meanwhile keeps its peers."""
        stale = [c for c in self.held if c not in self.paired or c not in self.consumers]
        if not stale:
            return
        busy = set(self.remote.values())
        for consumer in stale:
            if consumer not in busy:
                self.paired.discard(consumer)
                self._collected += self.engine.forget(consumer)
                self.held = self.held - {consumer}

    # -- remote prefills ---------------------------------------------------------------

    def _add_remote(self, rid: str, job: RemotePrefill, sampling: SamplingParams) -> None:
        """Hand a remote prefill to the engine, pairing with its consumer the first time one
        names it; a refusal (an unknown consumer, a refused pairing, a refused prompt) is a
        ``ValueError``: the prefill route answers it as the job's error."""
        cid = job.target.consumer
        if cid not in self.paired:
            endpoints = self.consumers.get(cid)
            if endpoints is None:
                raise ValueError(f"consumer {cid} has not paired with this prefill instance (POST {PAIR_PATH} first)")
            try:
                self._collected += self.engine.pair(endpoints, cid)
            except PairingRefused as err:
                if self.consumers.get(cid) is endpoints:
                    self.consumers.pop(cid, None)
                raise ValueError(f"pairing refused: {err}") from None
            self.paired.add(cid)
            self.pairings[cid] = self.pairings.get(cid, 0) + 1
            self.held = self.held | {cid}
        self.engine.add_request(list(job.prompt_token_ids), dataclasses.replace(sampling, max_tokens=1), rid,
                                kv_target=job.target)
        self.remote[rid] = cid


def add_prefill_routes(app: FastAPI, host: EngineHost, card: InstanceCard, *, api_key: str | None) -> None:
    backend: PrefillBackend = host.backend
    guard = [Depends(bearer_guard(api_key))]
    host.metrics.count_pairings(backend.pairings)
    host.metrics.registry.register(ReuseCollector(producer=backend.engine))
    host.metrics.count_kv_transfer(lambda: (backend.engine.kv_bytes_sent, backend.engine.kv_blocks_sent))
    dropped = Counter("pdflow_remote_prefills_aborted", "Remote prefills a consumer asked to drop, its request "
                      "ended first (client gone, time up).", registry=host.metrics.registry)
    Gauge("pdflow_kv_paired_consumers", "Consumer instances whose peers this instance's ranks hold now.",
          registry=host.metrics.registry).set_function(lambda: len(backend.held))

    @app.get(INSTANCE_PATH, dependencies=guard)
    async def instance():
        return msgspec.to_builtins(card) | {"prefills": backend.prefills, "pairings": dict(backend.pairings),
                                            "paired_consumers": sorted(backend.held)}

    @app.post(PAIR_PATH, dependencies=guard)
    async def pair(request: Request):
        ask = _decode(await request.body(), PairRequest)
        if ask.fingerprint != card.fingerprint:
            raise APIError(409, f"RunGraphMismatch: consumer {ask.consumer_id} describes run graph "
                           f"{ask.fingerprint}, this prefill instance {card.fingerprint}; start both with the "
                           "same overrides", code="run_graph_mismatch")
        if backend.consumers.get(ask.consumer_id) != ask.endpoints:  # new, or its ranks changed
            backend.consumers[ask.consumer_id] = ask.endpoints
            backend.paired.discard(ask.consumer_id)  # its ranks pair (again) on its next prefill
        return {"paired": ask.consumer_id}

    @app.post(UNPAIR_PATH, dependencies=guard)
    async def unpair(request: Request):
        ask = _decode(await request.body(), ForgetConsumer)
        backend.unpair(ask.consumer)  # its peers close on the engine loop's thread
        return {"unpaired": ask.consumer}

    @app.post(PREFILL_PATH, dependencies=guard)
    async def prefill(request: Request):
        job = _decode(await request.body(), RemotePrefill)  # its sampling checked on decoding: a 400
        key = (job.target.consumer, job.request_id)
        if backend.early_aborts.pop(key, None) is not None:  # its consumer gave up already
            dropped.inc()
            return Response(msgspec.json.encode(PrefillAnswer(error="ended: abort")), media_type="application/json")
        ticket, events = host.loop.open_stream(job.prompt_token_ids, dataclasses.replace(job.sampling, max_tokens=1),
                                               route=PDRoute(remote=job))
        backend.jobs[key] = ticket
        try:
            event = await events.get()
            while not event.done:
                event = await events.get()
        finally:
            backend.jobs.pop(key, None)
        answer = backend.answers.pop(ticket.request_id, None) if ticket.request_id else None
        if answer is None:
            # Aborted: the consumer frees its blocks on this answer (a dead loop settles nothing more).
            while ticket.request_id in backend.settling and host.loop.healthy:
                await asyncio.sleep(SETTLE_POLL_S)
            answer = PrefillAnswer(error=event.error or f"ended: {event.finish_reason}")
        return Response(msgspec.json.encode(answer), media_type="application/json")

    @app.post(ABORT_PATH, dependencies=guard)
    async def abort(request: Request):
        ask = _decode(await request.body(), AbortPrefill)
        key, now = (ask.consumer, ask.request_id), time.monotonic()
        ticket = backend.jobs.get(key)
        if ticket is not None:
            host.loop.abort(ticket)
            dropped.inc()
        else:  # not here yet (refused when it comes), or answered already (forgotten in time)
            backend.early_aborts = {k: t for k, t in backend.early_aborts.items() if now - t < EARLY_ABORT_KEEP_S}
            backend.early_aborts[key] = now
        return {"aborted": ticket is not None}


def _decode(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as err:
        raise APIError(400, f"invalid {kind.__name__}: {err}", code="invalid_value") from None
