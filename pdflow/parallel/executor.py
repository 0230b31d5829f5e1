"""The owner's side of a multi-process instance: same calls as the in-process runner."""

from __future__ import annotations

from pdflow.graph import RunGraph
from pdflow.parallel.groups import driver_rank
from pdflow.parallel.launcher import Launcher, LocalLauncher
from pdflow.parallel.messages import StepInput, StepOutput
from pdflow.parallel.rank_worker import serve_rank


class DistributedExecutor:
    """Starts one process per rank of ``role`` (the launcher is swappable), sends every
    rank each step, and waits for the sampling rank's answer while watching all ranks."""

    def __init__(self, graph: RunGraph, role: str, launcher: Launcher | None = None):
        spec = graph.raise_if_refused().spec
        plan = graph.instance(role)
        self.step_timeout_s = (spec.prefill if role == "prefill" else spec.decode).step_timeout_s
        self.driver = driver_rank(plan)
        self.launcher = launcher or LocalLauncher(spec, role, serve_rank, [r.label for r in plan.ranks])
        self.ready = self.launcher.start()

    @property
    def pids(self) -> list[int]:
        return self.launcher.pids

    def execute(self, step: StepInput) -> StepOutput:
        self.launcher.broadcast(step)
        out = self.launcher.recv(self.driver, self.step_timeout_s)
        if not isinstance(out, StepOutput) or out.step != step.step:
            raise RuntimeError(f"expected StepOutput for step {step.step}, got {out!r:.200}")
        return out

    def shutdown(self) -> None:
        self.launcher.shutdown()
