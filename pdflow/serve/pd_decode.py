"""A consumer instance served on its own (``pdflow serve serve.role=decode``).

A request with the router's ``x-pdflow-prefill: <producer URL>`` header is admitted as
``Deployment`` admits one (``engine/remote_admission``); a worker thread pairs with that
producer once (``POST /pdflow/pair``) and asks it to prefill into the allocated blocks
(``POST /pdflow/prefill``); the answer's first token resumes the request here. A failed
exchange ends the request and frees its blocks; an aborted one asks the producer to drop
the prefill (``POST /pdflow/abort``) and frees them only once the producer has answered,
so no late write lands in reused blocks. A request without the
header is served whole. On shutdown each paired producer is told (``/pdflow/unpair``).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import sys
import threading
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
from fastapi import Depends, FastAPI, Request

from pdflow.engine.engine_facts import EngineFacts
from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.outputs import TokenOutput
from pdflow.engine.remote_admission import ReuseCounts, admit_to_consumer, settle_remote
from pdflow.engine.sampling_params import SamplingParams
from pdflow.parallel.messages import ForgetConsumer
from pdflow.serve.api import EngineHost, bearer_guard
from pdflow.serve.backend import DraftCounts, DraftStats
from pdflow.serve.pd_wire import (
    ABORT_PATH,
    INSTANCE_PATH,
    PAIR_PATH,
    PREFILL_HEADER,
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

IDLE_WAIT_S = 0.005
EXCHANGE_THREADS = 8
UNPAIR_TIMEOUT_S = 2.0  # per producer, on shutdown: a producer that does not answer forgets on its own
ABORT_TIMEOUT_S = 5.0  # telling a producer to drop a prefill (best effort: its answer frees the blocks)


def prefill_route(request: Request) -> PDRoute | None:
    """An API request's route on this consumer: the producer the router's header names
    (None without the header: this instance prefills it)."""
    producer = request.headers.get(PREFILL_HEADER, "").rstrip("/")
    return PDRoute(prefill_at=producer) if producer else None


class DecodeBackend(EngineFacts):
    """The consumer's ``ServingBackend``."""

    def __init__(self, engine: LLMEngine, *, fingerprint: str, api_key: str | None, timeout_s: float):
        self.engine = engine
        self.consumer_id = uuid.uuid4().hex[:12]
        self.pair_request = PairRequest(consumer_id=self.consumer_id, fingerprint=fingerprint,
                                        endpoints=engine.instance.open_kv_link())
        # Requests the pool was full for: id, prompt, sampling, producer URL.
        self.waiting: deque[tuple[str, list[int], SamplingParams, str]] = deque()
        self.aborted: set[str] = set()
        self.producer_of: dict[str, str] = {}  # exchanges under way: the producer URL
        # Exchanges answered; None: ``wake`` (a command is waiting for the loop).
        self.results: queue.SimpleQueue[tuple[str, PrefillAnswer] | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._draft_counts = DraftCounts()
        self.pairings: dict[str, int] = {}  # POST /pdflow/pair answered, per producer URL (/metrics)
        self.reuse = ReuseCounts()  # remote and local prefills, prompt tokens reused (/metrics)
        self._pair_lock = threading.Lock()
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0), headers=headers)
        self._pool = ThreadPoolExecutor(EXCHANGE_THREADS, thread_name_prefix="pdflow-prefill")
        # Aborts go on a thread of their own: the exchange threads may all be waiting for answers.
        self._aborts = ThreadPoolExecutor(1, thread_name_prefix="pdflow-abort")

    # -- ServingBackend (the rest: EngineFacts) ----------------------------------------

    def add(self, prompt_token_ids: list[int], sampling: SamplingParams, *, route: PDRoute | None = None) -> str:
        if route is not None and route.prefill_at is None:
            raise RouteRefused("a decode instance has its prompts prefilled at a producer (PDRoute.prefill_at); "
                             "it takes no remote prefill (PDRoute.remote: a prefill instance's)")
        rid = f"r{next(self._ids)}"
        if route is None:  # no router header: prefilled here
            self.reuse.local_prefills += 1
            return self.engine.add_request(list(prompt_token_ids), sampling, rid)
        prompt = list(prompt_token_ids)
        if not self._start(rid, prompt, sampling, route.prefill_at):  # a refused prompt raises here
            self.waiting.append((rid, prompt, sampling, route.prefill_at))
        return rid

    def abort(self, request_id: str) -> bool:
        if request_id in self.engine.awaiting_kv:
            self.aborted.add(request_id)  # its blocks are freed once the producer answers
            if (producer := self.producer_of.get(request_id)) is not None:
                with contextlib.suppress(RuntimeError):  # shutting down: nothing more is sent
                    self._aborts.submit(self._tell_abort, producer, request_id)
            return True
        for item in self.waiting:
            if item[0] == request_id:
                self.waiting.remove(item)
                return True
        return self.engine.abort(request_id)

    def step(self) -> list[TokenOutput]:
        while self.waiting and self._start(*self.waiting[0]):
            self.waiting.popleft()
        outputs = self._take_results(wait=not self.engine.has_unfinished())
        if self.engine.has_unfinished():
            outputs += self._draft_counts.keep(self.engine.step())
        return outputs

    def wake(self) -> None:
        self.results.put(None)

    def draft_stats(self, request_id: str) -> DraftStats | None:
        return self._draft_counts.pop(request_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._aborts.shutdown(wait=False, cancel_futures=True)
        self._unpair_all()
        self._client.close()
        self.engine.shutdown()

    def _unpair_all(self) -> None:
        """Best effort: a producer that misses this forgets this instance when a transfer
        to it fails."""
        for producer in list(self.pairings):
            try:
                self._post(producer + UNPAIR_PATH, ForgetConsumer(consumer=self.consumer_id),
                           timeout=UNPAIR_TIMEOUT_S)
            except (httpx.HTTPError, RuntimeError) as err:
                print(f"pdflow: {producer} was not told this decode instance stops: {err}", file=sys.stderr)

    # -- the exchange ------------------------------------------------------------------

    def _start(self, rid: str, prompt: list[int], sampling: SamplingParams, producer: str) -> bool:
        """Allocate the prompt's blocks and hand its prefill at ``producer`` to a worker
        thread; False while the pool is short."""
        admitted = admit_to_consumer(self.engine, prompt, sampling, rid, counts=self.reuse,
                                     consumer_id=self.consumer_id)
        if admitted.local or admitted.target is None:
            return admitted.local
        job = RemotePrefill(request_id=rid, prompt_token_ids=prompt, sampling=sampling, target=admitted.target)
        self.producer_of[rid] = producer
        self._pool.submit(self._exchange, producer, job)
        return True

    def _exchange(self, producer: str, job: RemotePrefill) -> None:
        try:
            self._pair(producer)
            answer = self._post(producer + PREFILL_PATH, job, PrefillAnswer)
        except Exception as err:  # every failure ends this request, never the instance
            answer = PrefillAnswer(error=f"prefill at {producer} failed: {err}")
        self.results.put((job.request_id, answer))

    def _tell_abort(self, producer: str, request_id: str) -> None:
        """Best effort: a producer that misses this prefills the request anyway, and its
        answer frees the blocks as before."""
        try:
            self._post(producer + ABORT_PATH, AbortPrefill(consumer=self.consumer_id, request_id=request_id),
                       timeout=ABORT_TIMEOUT_S)
        except (httpx.HTTPError, RuntimeError) as err:
            print(f"pdflow: {producer} was not told request {request_id} ended: {err}", file=sys.stderr)

    def _pair(self, producer: str) -> None:
        with self._pair_lock:
            if producer not in self.pairings:
                self._post(producer + PAIR_PATH, self.pair_request)
                self.pairings[producer] = 1

    def _post(self, url: str, message, kind=None, timeout=httpx.USE_CLIENT_DEFAULT):
        r = self._client.post(url, content=msgspec.json.encode(message), timeout=timeout,
                              headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:500]}")
        return msgspec.json.decode(r.content, type=kind) if kind is not None else None

    def _take_results(self, *, wait: bool) -> list[TokenOutput]:
        """Settle every exchange answered so far (waiting ``IDLE_WAIT_S`` for the first when
        ``wait``, or until ``wake``: a request that came meanwhile is admitted at once, not
        after the wait)."""
        outputs = []
        try:
            item = self.results.get(timeout=IDLE_WAIT_S) if wait else self.results.get_nowait()
            while True:
                if item is None:  # woken
                    item = self.results.get_nowait()
                    continue
                rid, answer = item
                aborted = rid in self.aborted
                self.aborted.discard(rid)
                self.producer_of.pop(rid, None)
                settled = settle_remote(self.engine, rid, answer.first, answer.error, aborted=aborted)
                if not aborted:  # an aborted one has ended already (its abort answered)
                    outputs.append(settled)
                item = self.results.get_nowait()
        except queue.Empty:
            return outputs


def add_decode_routes(app: FastAPI, host: EngineHost, card: InstanceCard, *, api_key: str | None) -> None:
    backend: DecodeBackend = host.backend
    host.metrics.count_pairings(backend.pairings)
    host.metrics.registry.register(ReuseCollector(consumer=backend.engine, counts=backend.reuse))

    @app.get(INSTANCE_PATH, dependencies=[Depends(bearer_guard(api_key))])
    async def instance():
        return msgspec.to_builtins(card) | {"consumer_id": backend.consumer_id, "pairings": dict(backend.pairings)}

