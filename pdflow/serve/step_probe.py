"""The served engine's decode step and first token, for ``pdflow profile``: the shipped
tiny model served alone with a given layout (``tp`` x ``pp`` rank processes; tp1 x pp1:
in the serving process), driven by streamed requests.

A decode step is read from the server's own counters (``pdflow_engine_step_seconds`` /
``pdflow_engine_steps`` by kind and rows: each busy engine turn timed where it runs), as
a mean over each round's steps, the median of several rounds: the median gap a client saw
between SSE chunks moved 5-18 ms between consecutive profiles of a TP2 step (a bimodal
gap's median flips between its modes; the mean over many steps, which is also what a
served run's time per output token is, does not), and on a GPU a ~1 ms step's estimate
moved with tenths of a ms of the client's own host time. A first token is what a client
sees (HTTP, admission, the stream are what it prices): ``BATCH`` requests at once, the
median over rounds of the time to the last first token.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdflow.bench.profile import ServedProbe
from pdflow.bench.served_costs import probe_overrides
from pdflow.bench.workloads import Target, WorkRequest, drive
from pdflow.spec.load import compose_spec

TOKENS = 48  # a decode round's tokens per stream
ROUNDS = 5  # rounds of each measurement; the median is kept
PROMPT = [5, 6, 7, 8]
BATCH = 4  # streams at once for the per-row cost of a step
# A longer prompt for the part of a request's cost that grows with it (on 2 cores 4 prompts
# of 128 tokens took ~50 ms beyond their priced compute where 4 of 4 tokens took ~17)
LONG = 128


def long_prompts(n: int, salt: int) -> list[list[int]]:
    """``n`` different ``LONG``-token prompts (the prefix cache holds none of them: the
    same prompt again would be served from it after the first round)."""
    rng = random.Random(f"probe:{salt}")
    return [[rng.randrange(5, 105) for _ in range(LONG)] for _ in range(n)]


STEP_COUNTERS = {"pdflow_engine_steps_total": 0, "pdflow_engine_step_seconds_total": 1}


def step_totals(text: str) -> dict[tuple[str, int], tuple[float, float]]:
    """(kind, rows) -> (steps, seconds) from a ``/metrics`` page (Prometheus' own parser)."""
    out: dict[tuple[str, int], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in STEP_COUNTERS:
                slot = out.setdefault((sample.labels["kind"], int(sample.labels["rows"])), [0.0, 0.0])
                slot[STEP_COUNTERS[sample.name]] = sample.value
    return {key: (steps, seconds) for key, (steps, seconds) in out.items()}


def decode_gap_s(before: dict, after: dict, streams: int) -> float:
    """A stream's mean time per token between two ``step_totals`` readings: the busy
    turns' seconds (decode steps and empty ones, a pipeline's bubbles) over the decode
    tokens each stream got (0: no decode step in between)."""
    def delta(key, i):
        return after.get(key, (0.0, 0.0))[i] - before.get(key, (0.0, 0.0))[i]

    keys = set(before) | set(after)
    tokens = sum(rows * delta((kind, rows), 0) for kind, rows in keys if kind == "decode")
    seconds = sum(delta(key, 1) for key in keys if key[0] in ("decode", "empty"))
    return seconds / (tokens / streams) if tokens > 0 else 0.0


def served_probe(device: str, tp: int = 1, pp: int = 1, disaggregated: bool = False) -> ServedProbe:
    """The tiny model served with ``tp`` x ``pp`` rank processes: a decode step with one
    stream (tp1 x pp1 only: the step overhead) and with ``BATCH``, each the median of
    ``ROUNDS`` rounds' server-timed means; the first tokens of ``BATCH`` short and long
    prompts at once; with rank processes, the prompt tokens/s of long prompts ``BATCH`` at a
    time; a lone short prompt's TTFT. ``disaggregated``: P/D tp1 -> ``tp``, first
    tokens only (what a request's exchange between the instances costs)."""
    from pdflow.serve.launch import serve_spec

    spec = compose_spec(probe_overrides(device, tp, pp, disaggregated))
    with serve_spec(spec, port=0) as served:
        target = Target(url=served.url, model=served.model_name, api_key=served.api_key)
        headers = {"Authorization": f"Bearer {served.api_key}"} if served.api_key else {}

        def run(requests: list[WorkRequest], concurrency: int):
            return asyncio.run(drive(target, requests, concurrency=concurrency, timeout_s=600, progress=False))[0]

        def totals():
            return step_totals(httpx.get(f"{served.url}/metrics", headers=headers, timeout=60).text)

        def decode_rounds(streams: int) -> list[float]:
            request = WorkRequest(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True)
            gaps = []
            for _ in range(ROUNDS):
                before = totals()
                run([request] * streams, streams)
                gaps.append(decode_gap_s(before, totals(), streams))
            return gaps

        def batch_ttft(long: bool) -> list[float]:
            """``BATCH`` one-token requests at once: the time to the last first token."""
            def asks(i):
                prompts = long_prompts(BATCH, i) if long else [PROMPT] * BATCH
                return [WorkRequest(prompt=p, max_tokens=1, ignore_eos=True) for p in prompts]

            return [max(r.ttft_s or 0.0 for r in run(asks(i), BATCH)) for i in range(ROUNDS)]

        def prefill_rate() -> list[float]:
            """Prompt tokens/s of ``2 * BATCH`` long prompts, ``BATCH`` at a time (a pipeline
            of stages keeps steps in flight: what it sustains, not one batch's latency)."""
            rates = []
            for i in range(ROUNDS):
                asks = [WorkRequest(prompt=p, max_tokens=1, ignore_eos=True)
                        for p in long_prompts(2 * BATCH, 1000 + i)]
                _, wall = asyncio.run(drive(target, asks, concurrency=BATCH, timeout_s=600, progress=False))
                rates.append(2 * BATCH * LONG / wall)
            return rates

        run([WorkRequest(prompt=p, max_tokens=16, ignore_eos=True) for p in long_prompts(BATCH, -1)], BATCH)  # warm
        one = decode_rounds(1) if tp * pp == 1 and not disaggregated else []
        many = [] if disaggregated else decode_rounds(BATCH)
        firsts = run([WorkRequest(prompt=PROMPT, max_tokens=1, ignore_eos=True)] * ROUNDS, 1)
        short, long = batch_ttft(False), batch_ttft(True)
        rate = prefill_rate() if tp * pp > 1 and not disaggregated else []
    median = statistics.median
    return ServedProbe(tp=tp, pp=pp, disaggregated=disaggregated, step_s=median(one or many or [0.0]), batch=BATCH,
                       batch_step_s=median(many or [0.0]),
                       ttft_s=median([r.ttft_s for r in firsts if r.ttft_s is not None]),
                       batch_ttft_s=median(short), long_prompt_tokens=LONG, batch_long_ttft_s=median(long),
                       prefill_tok_s=median(rate or [0.0]), prompt_tokens=len(PROMPT), context=len(PROMPT) + TOKENS // 2,
                       rounds={"step_s": one, "batch_step_s": many, "batch_ttft_s": short, "batch_long_ttft_s": long,
                               "prefill_tok_s": rate})
