"""The served engine's decode step and first token, for ``pdflow profile``: the shipped
tiny model served alone (one rank, this device), one streamed request of a 4-token
prompt; the median gap between its tokens is one decode step as ``pdflow run`` sees it
(engine loop, API and stream included), its TTFT what a request costs end to end, alone
and ``BATCH`` at once.
With two rank processes, what a step costs beyond its compute and collectives is the
rank processes' own per-step work (message, wake-up, tensors from the step's lists)."""

from __future__ import annotations

import asyncio

from pdflow.bench.profile import ServedProbe
from pdflow.bench.workloads import Target, WorkRequest, drive
from pdflow.spec.load import compose_spec

TOKENS = 96  # gaps per stream: 48 left a TP2 step's median moving 2x between profiles
PROMPT = [5, 6, 7, 8]
BATCH = 4  # streams at once for the per-row cost of a step
# A longer prompt for the part of a request's cost that grows with it (on 2 cores 4 prompts
# of 128 tokens took ~50 ms beyond their priced compute where 4 of 4 tokens took ~17)
LONG_PROMPT = [5 + i % 100 for i in range(128)]


def served_probe(device: str, tp: int = 1) -> ServedProbe:
    """One decode step and the first token of the tiny model served with ``tp`` rank
    processes (``tp=1``: in the serving process); the TTFT is the median of a few; the
    batch step the median gap with ``BATCH`` streams at once."""
    from pdflow.bench.workloads.stats import percentile
    from pdflow.serve.launch import serve_spec

    spec = compose_spec(["model=tiny", "mode=monolithic", f"decode=tp{tp}", "drafter=none", "tracking=off",
                         f"decode.device={device}", f"prefill.device={device}"])
    with serve_spec(spec, port=0) as served:
        target = Target(url=served.url, model=served.model_name, api_key=served.api_key)
        request = WorkRequest(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True)
        asyncio.run(drive(target, [request], concurrency=1, timeout_s=600, progress=False))  # warm-up
        results, _ = asyncio.run(drive(target, [request], concurrency=1, timeout_s=600, progress=False))
        short = WorkRequest(prompt=PROMPT, max_tokens=1, ignore_eos=True)
        firsts, _ = asyncio.run(drive(target, [short] * 5, concurrency=1, timeout_s=600, progress=False))
        batch, _ = asyncio.run(drive(target, [request] * BATCH, concurrency=BATCH, timeout_s=600, progress=False))
        def batch_ttft(prompt: list[int]) -> float:
            """``BATCH`` one-token requests at once, 5 rounds: the median time to the last
            first token."""
            ask = WorkRequest(prompt=prompt, max_tokens=1, ignore_eos=True)
            rounds = [asyncio.run(drive(target, [ask] * BATCH, concurrency=BATCH, timeout_s=600, progress=False))[0]
                      for _ in range(5)]
            return percentile([max(r.ttft_s or 0.0 for r in got) for got in rounds], 50)

        together, together_long = batch_ttft(PROMPT), batch_ttft(LONG_PROMPT)
    return ServedProbe(step_s=percentile(results[0].itl_s, 50),
                       batch=BATCH, batch_step_s=percentile([g for r in batch for g in r.itl_s], 50),
                       ttft_s=percentile([r.ttft_s for r in firsts if r.ttft_s is not None], 50),
                       batch_ttft_s=together, long_prompt_tokens=len(LONG_PROMPT), batch_long_ttft_s=together_long,
                       prompt_tokens=len(PROMPT), context=len(PROMPT) + TOKENS // 2)
