"""The served engine's decode step, for ``pdflow profile``: the shipped tiny model served
alone (one rank, this device), one streamed request; the median gap between its tokens
is one decode step as ``pdflow run`` sees it (engine loop, API and stream included).
With two rank processes, what a step costs beyond its compute and collectives is the
rank processes' own per-step work (message, wake-up, tensors from the step's lists)."""

from __future__ import annotations

import asyncio

from pdflow.bench.workloads import Target, WorkRequest, drive
from pdflow.spec.load import compose_spec

TOKENS = 48


def served_step_s(device: str, tp: int = 1) -> float:
    """Seconds of one decode step of the tiny model served with ``tp`` rank processes
    (``tp=1``: in the serving process)."""
    from pdflow.bench.workloads.stats import percentile
    from pdflow.serve.launch import serve_spec

    spec = compose_spec(["model=tiny", "mode=monolithic", f"decode=tp{tp}", "drafter=none", "tracking=off",
                         f"decode.device={device}", f"prefill.device={device}"])
    with serve_spec(spec, port=0) as served:
        target = Target(url=served.url, model=served.model_name, api_key=served.api_key)
        request = WorkRequest(prompt=[5, 6, 7, 8], max_tokens=TOKENS, ignore_eos=True)
        asyncio.run(drive(target, [request], concurrency=1, timeout_s=600, progress=False))  # warm-up
        results, _ = asyncio.run(drive(target, [request], concurrency=1, timeout_s=600, progress=False))
    return percentile(results[0].itl_s, 50)
