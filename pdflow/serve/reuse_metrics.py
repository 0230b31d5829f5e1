"""Prometheus counters of prefix reuse on one P/D instance, read from the engine at every
scrape (no bookkeeping of their own).

Both sides: ``pdflow_prefix_cache_hit_tokens_total`` (prompt tokens this instance's
prefix cache served). Prefill side: ``pdflow_kv_sent_blocks_total`` and
``pdflow_kv_sent_bytes_total`` (prompt KV handed to the sender). Decode side:
``pdflow_kv_received_blocks_total``/``_bytes_total`` (blocks producers were asked to
write here), ``pdflow_kv_reused_tokens_total`` (prompt tokens that did not move: this
instance had them) and ``pdflow_prefills_total{where=remote|local}``.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.remote_admission import ReuseCounts


class ReuseCollector:
    """``counts``: the decode side's admissions; None on a prefill instance."""

    def __init__(self, engine: LLMEngine, counts: ReuseCounts | None = None):
        self.engine, self.counts = engine, counts

    def collect(self):
        bpb = self.engine.graph.transfer_bytes_per_block
        yield CounterMetricFamily("pdflow_prefix_cache_hit_tokens", "Prompt tokens served from this "
                                  "instance's prefix cache.", value=self.engine.blocks.hit_tokens)
        c = self.counts
        if c is None:
            blocks = self.engine.exported_blocks
            yield CounterMetricFamily("pdflow_kv_sent_blocks", "Prompt KV blocks sent to decode instances.",
                                      value=blocks)
            yield CounterMetricFamily("pdflow_kv_sent_bytes", "Prompt KV bytes sent to decode instances.",
                                      value=blocks * bpb)
            return
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
