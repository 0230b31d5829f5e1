"""Prometheus metrics of one server, in its own registry (several apps may share a process).

Latencies are observed on the engine-loop thread as tokens leave the engine; request
outcomes where the HTTP handler decides them (including refused requests).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from pdflow.serve.backend import ServingBackend
from pdflow.serve.serving_core import StreamEvent, Ticket

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, float("inf"))


class ServeMetrics:
    def __init__(self, backend: ServingBackend, *, num_active=lambda: 0, prefix: str = "pdflow"):
        self.registry = CollectorRegistry()
        self._drafted = self._accepted = 0
        r, p = self.registry, prefix
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        # TTFT's two parts, as vLLM's request_queue_time / request_prefill_time: waiting for
        # KV blocks, then the prefill (under P/D: the exchange too) until the first token.
        self.queue_time = Histogram(f"{p}_request_queue_time_seconds",
                                    "Arrival to admission into the engine (waiting for KV blocks).",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram(f"{p}_request_prefill_time_seconds",
                                      "Admission into the engine to the first token.",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Gap between a request's tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter(f"{p}_requests", "Finished requests by outcome.", ["outcome"], registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated.", registry=r)
        self.drafted = Counter(f"{p}_draft_tokens", "Speculative tokens proposed.", registry=r)
        self.accepted = Counter(f"{p}_accepted_draft_tokens", "Speculative tokens accepted.", registry=r)
        self.verify_steps = Counter(f"{p}_verify_steps", "Speculative verify forwards.", registry=r)
        # Engine steps as served, timed where they run (start of a busy turn to the next):
        # their mean over a window, by kind and rows, without a client's jitter in it.
        self.steps = Counter(f"{p}_engine_steps", "Busy engine turns by step kind and rows.", ["kind", "rows"],
                             registry=r)
        self.step_seconds = Counter(f"{p}_engine_step_seconds", "Seconds of busy engine turns by step kind and rows.",
                                    ["kind", "rows"], registry=r)
        self._step_children: dict[tuple[str, int], tuple] = {}
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        Gauge(f"{p}_kv_blocks_total", "KV blocks in the pool.", registry=r).set_function(
            lambda: backend.num_kv_blocks)
        Gauge(f"{p}_kv_blocks_free", "KV blocks free.", registry=r).set_function(
            lambda: backend.num_free_kv_blocks)
        Gauge(f"{p}_kv_blocks_used", "KV blocks held by requests or the prefix cache.",
              registry=r).set_function(lambda: backend.num_kv_blocks - backend.num_free_kv_blocks)
        Gauge(f"{p}_draft_acceptance_rate", "Accepted / proposed speculative tokens (NaN: none).",
              registry=r).set_function(self._acceptance)
        Gauge(f"{p}_startup_seconds", "Seconds the instances took to be ready, warm-up included.",
              registry=r).set_function(lambda: backend.startup_s)
        Gauge(f"{p}_compile_seconds", "Seconds of the start-up spent compiling (CPU op, kernels, graphs).",
              registry=r).set_function(lambda: backend.compile_s)
        Gauge(f"{p}_requests_running", "Requests in the engine.", registry=r).set_function(num_active)

    def _acceptance(self) -> float:
        return self._accepted / self._drafted if self._drafted else math.nan

    def on_token(self, ticket: Ticket, now: float) -> None:
        if ticket.last_token_at is None:
            self.ttft.observe(now - ticket.arrival)
            if ticket.admitted_at is not None:
                self.queue_time.observe(ticket.admitted_at - ticket.arrival)
                self.prefill_time.observe(now - ticket.admitted_at)
            self.prompt_tokens.inc(len(ticket.prompt_token_ids))
        else:
            self.itl.observe(now - ticket.last_token_at)
        self.generation_tokens.inc()

    def on_step(self, kind: str, rows: int, seconds: float) -> None:
        """Every engine step calls this: the labelled children are looked up once per
        (kind, rows), not per step (``labels`` takes a lock and builds its key)."""
        children = self._step_children.get((kind, rows))
        if children is None:
            children = self._step_children[kind, rows] = (self.steps.labels(kind=kind, rows=str(rows)),
                                                          self.step_seconds.labels(kind=kind, rows=str(rows)))
        children[0].inc()
        children[1].inc(seconds)

    def on_finish(self, ticket: Ticket, event: StreamEvent) -> None:
        if event.token_ids and ticket.last_token_at is not None:
            self.e2e.observe(ticket.last_token_at - ticket.arrival)
        if event.draft is not None:
            self._drafted += event.draft.drafted
            self._accepted += event.draft.accepted
            self.drafted.inc(event.draft.drafted)
            self.accepted.inc(event.draft.accepted)
            self.verify_steps.inc(event.draft.verify_steps)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def count_pairings(self, counts: dict[str, int]) -> None:
        """P/D instances: ``pdflow_kv_pairings_total{peer=}``, how often this instance's
        ranks paired with each peer instance (read from ``counts`` at every scrape)."""
        self.registry.register(PairingCounts(counts))

    def count_kv_transfer(self, totals: Callable[[], tuple[int, int]]) -> None:
        """A P/D producer: ``pdflow_kv_transfer_bytes_total`` and ``..._blocks_total``, the
        KV bytes its ranks moved and the prompt blocks that landed (``totals()`` read at
        every scrape); their ratio is the bytes per transferred block the plan shows."""
        self.registry.register(KVTransferTotals(totals))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class KVTransferTotals:
    """A collector of a producer's transferred KV: bytes and blocks."""

    def __init__(self, totals: Callable[[], tuple[int, int]]):
        self.totals = totals

    def collect(self):
        nbytes, blocks = self.totals()
        yield CounterMetricFamily("pdflow_kv_transfer_bytes", "KV bytes the producer's ranks moved.",
                                  value=nbytes)
        yield CounterMetricFamily("pdflow_kv_transfer_blocks", "Prompt KV blocks that landed.", value=blocks)


class PairingCounts:
    """A collector of pairings per peer instance (a producer: per consumer id; a consumer:
    per producer URL). Each pair should pair once; more means the ranks re-paired."""

    def __init__(self, counts: dict[str, int]):
        self.counts = counts

    def collect(self):
        family = CounterMetricFamily("pdflow_kv_pairings", "KV pairings with each peer instance.",
                                     labels=["peer"])
        for peer, n in dict(self.counts).items():
            family.add_metric([peer], n)
        yield family
