"""The owner's side of a multi-process instance: same calls as the in-process runner."""

from __future__ import annotations

from collections import deque

from pdflow.graph import RunGraph, parallel_of
from pdflow.parallel.groups import driver_rank
from pdflow.parallel.launcher import Launcher, LocalLauncher
from pdflow.parallel.messages import StepInput, StepOutput

# The rank body every rank process runs (imported there by name, never pickled).
RANK_TARGET = "pdflow.parallel.rank_worker:serve_rank"


class DistributedExecutor:
    """Starts one process per rank of ``role`` (the launcher is swappable), sends every
    rank each step, and waits for the sampling rank's answer while watching all ranks.

    Up to ``depth`` steps are in flight, by default one per pipeline stage
    (``ParallelSpec.max_steps_in_flight``): stage 0 starts step k+1
    while stage 1 runs step k (ranks take their steps in order, so a step's K/V writes at
    a stage land before any later step reads them). Answers come back in step order.
    """

    def __init__(self, graph: RunGraph, role: str, launcher: Launcher | None = None):
        spec = graph.raise_if_refused().spec
        plan = graph.instance(role)
        par = parallel_of(spec, role)
        self.step_timeout_s = par.step_timeout_s
        self.driver = driver_rank(plan)
        self.depth = par.steps_in_flight
        self.launcher = launcher or LocalLauncher(spec, role, RANK_TARGET, [r.label for r in plan.ranks])
        self.launcher.start()
        self._pending: deque[int] = deque()
        self.max_in_flight = 0  # the most steps ever in flight at once (reported, tested)

    @property
    def pids(self) -> list[int]:
        return self.launcher.pids

    def submit(self, step: StepInput) -> None:
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"{self.depth} steps already in flight; collect one first")
        self.launcher.broadcast(step)
        self._pending.append(step.step)
        self.max_in_flight = max(self.max_in_flight, len(self._pending))

    def collect(self) -> StepOutput:
        """The oldest step's answer (the timeout runs per step, from when it is awaited)."""
        want = self._pending.popleft()
        out = self.launcher.recv(self.driver, self.step_timeout_s)
        if not isinstance(out, StepOutput) or out.step != want:
            raise RuntimeError(f"expected StepOutput for step {want}, got {out!r:.200}")
        return out

    def execute(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.collect()

    def shutdown(self) -> None:
        self.launcher.shutdown()
