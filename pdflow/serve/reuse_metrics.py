"""Prometheus counters of prefix reuse on a P/D server, read from the engines at every
scrape (no bookkeeping of their own).

``pdflow_prefix_cache_hit_tokens_total{side=prefill|decode}``: prompt tokens each side's
prefix cache served. Prefill side: ``pdflow_kv_sent_blocks_total`` and
``pdflow_kv_sent_bytes_total`` (prompt KV handed to the sender). Decode side:
``pdflow_kv_received_blocks_total``/``_bytes_total`` (blocks producers were asked to
write here), ``pdflow_kv_reused_tokens_total`` (prompt tokens that did not move: this
instance had them), ``pdflow_prefills_total{where=remote|local}`` and
``pdflow_local_prefills_for_producer_misses_total``. A separately
started instance reports its side; ``Deployment`` behind one server reports both.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.remote_admission import ReuseCounts


class ReuseCollector:
    """``producer``: the prefill side's engine, if this server has it; ``consumer`` and
    its admission ``counts``: the decode side's."""

    def __init__(self, *, producer: LLMEngine | None = None, consumer: LLMEngine | None = None,
                 counts: ReuseCounts | None = None):
        if consumer is not None and counts is None:
            raise ValueError("a decode side's reuse counters need its admission counts")
        self.producer, self.consumer, self.counts = producer, consumer, counts

    def collect(self):
        hits = CounterMetricFamily("pdflow_prefix_cache_hit_tokens", "Prompt tokens served from a side's "
                                   "prefix cache.", labels=["side"])
        for side, engine in (("prefill", self.producer), ("decode", self.consumer)):
            if engine is not None:
                hits.add_metric([side], engine.blocks.hit_tokens)
        yield hits
        if self.producer is not None:
            blocks, bpb = self.producer.exported_blocks, self.producer.graph.transfer_bytes_per_block
            yield CounterMetricFamily("pdflow_kv_sent_blocks", "Prompt KV blocks sent to decode instances.",
                                      value=blocks)
            yield CounterMetricFamily("pdflow_kv_sent_bytes", "Prompt KV bytes sent to decode instances.",
                                      value=blocks * bpb)
        if self.consumer is None:
            return
        c, bpb = self.counts, self.consumer.graph.transfer_bytes_per_block
        yield CounterMetricFamily("pdflow_kv_received_blocks", "Prompt KV blocks prefill instances were "
                                  "asked to write here.", value=c.requested_blocks)
        yield CounterMetricFamily("pdflow_kv_received_bytes", "Prompt KV bytes prefill instances were "
                                  "asked to write here.", value=c.requested_blocks * bpb)
        yield CounterMetricFamily("pdflow_kv_reused_tokens", "Prompt tokens of remote prefills whose KV "
                                  "did not move (this instance's prefix cache had them).", value=c.reused_tokens)
        family = CounterMetricFamily("pdflow_prefills", "Prompts by where they were prefilled.", labels=["where"])
        family.add_metric(["remote"], c.remote_prefills)
        family.add_metric(["local"], c.local_prefills)
        yield family
        yield CounterMetricFamily("pdflow_local_prefills_for_producer_misses", "Local prefills whose uncached "
                                  "part was not short, taken here because a producer would have recomputed "
                                  "router.local_prefill_factor times as much.", value=c.local_for_producer_misses)
