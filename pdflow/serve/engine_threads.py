"""The torch threads a process that steps an engine computes with.

Why: that engine's API (HTTP, tokenization, SSE) runs beside it on the same host, in a
thread of the same process (``role=prefill|decode``) or in front processes
(``role=deployment``). With every core given to torch, a CPU step's threads wait on
whichever one the API (or another instance) preempted: on 2 cores, decode steps ran 50%
slower served than offline (bench/RESULTS.md, issue 30), and a decode instance's local
prefill took twice its own CPU time in wall time (issue 33).
"""

from __future__ import annotations

import os

from pdflow.spec.run import ServeSpec


def set_engine_threads(serve: ServeSpec, cores: int | None = None) -> int:
    """Set this process's torch threads to ``serve.core_threads_on(cores)`` (``cores``:
    this host's by default); returns the count."""
    import torch

    threads = serve.core_threads_on(cores or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads
