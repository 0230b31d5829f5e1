"""The two ways an instance's owner runs its steps: on this process, or on one process per
rank. Both answer the engine's ``Executor`` protocol (submit, collect, depth, shutdown)
and run the same ``build_stage``.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from pdflow.graph import RunGraph, overlap_scheduling, parallel_of
from pdflow.parallel.groups import driver_rank
from pdflow.parallel.launcher import Launcher, LocalLauncher
from pdflow.parallel.messages import ControlMessage, ExportDone, Message, StepInput, StepOutput
from pdflow.worker.control import handle_control
from pdflow.worker.overlap_step import LaunchedStep, launch
from pdflow.worker.stage import Stage, build_stage, rank_device

RANK_TARGET = "pdflow.worker.rank_loop:serve_rank"


def on_own_device(method):
    """Runs an in-process executor's method with its GPU current: two in-process instances
    on two GPUs share a thread, and Triton launches on the current device."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)
    return wrapped


class InProcessExecutor:
    """The whole model (TP1/PP1) on this process's device. One step in flight: ``submit``
    runs it, ``collect`` hands the result back. Under overlap scheduling two: ``submit``
    launches the step and returns (its samples stay on the device for the next step's
    placeholders), ``collect`` waits for the oldest step's samples to reach the host."""

    overlap = False

    def __init__(self, graph: RunGraph, role: str):
        graph.raise_if_refused()
        plan = graph.instance(role)
        if len(plan.ranks) != 1:
            raise ValueError(f"{role} has {len(plan.ranks)} ranks; the in-process executor runs one")
        self.device = rank_device(parallel_of(graph.spec, role), plan.ranks[0])
        if self.device.type == "cuda":  # as a rank process does; methods below re-enter it
            torch.cuda.set_device(self.device)
        self.graph, self.role = graph, role
        self.stage: Stage | None = None
        self._build()
        self.overlap = overlap_scheduling(graph.spec, role)
        self.depth = 2 if self.overlap else 1
        self._done: deque[StepOutput | LaunchedStep] = deque()
        # Overlap: the last launched step's number and its sampled tokens, on the device.
        self._samples: tuple[int, torch.Tensor] | None = None

    @on_own_device
    def _build(self) -> None:
        self.stage = build_stage(self.graph, self.role, 0, self.device)
        self.stage.warm_up()

    @on_own_device
    def submit(self, step: StepInput) -> None:
        if not self.overlap:
            self._done.append(self.execute(step))
            return
        if len(self._done) >= self.depth:
            raise RuntimeError(f"{self.depth} steps already in flight; collect one first")
        samples = None
        if step.placeholder_rows:
            number, samples = self._samples or (-1, None)
            if number != step.placeholder_step:
                raise RuntimeError(f"step {step.step} reads step {step.placeholder_step}'s samples, "
                                   f"but the last step launched is {number}")
        if self.stage is None:
            raise RuntimeError("this instance has been shut down")
        launched, tokens = launch(self.stage, step, samples)
        self._samples = (step.step, tokens)
        self._done.append(launched)

    @on_own_device
    def collect(self) -> StepOutput:
        done = self._done.popleft()
        return done.result() if isinstance(done, LaunchedStep) else done

    @on_own_device
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        stage = self.stage
        if stage is None:
            raise RuntimeError("this instance has been shut down")
        drafted = stage.replay_drafted(step)
        if drafted is not None:
            return stage.answer(step, None, None, True, drafted)
        ids, positions, meta = stage.runner.tensors(step)
        hidden, taps, graphed = stage.forward(ids, positions, meta)
        drafted = stage.draft(step, ids, positions, meta, hidden, taps)
        failed = stage.export(step.exports) if step.exports else {}
        logits = stage.runner.logits(step, hidden) if drafted is None else None
        out = stage.answer(step, logits, taps, graphed, drafted, stage.score_prompts(step, hidden))
        out.export_failed = failed
        return out

    def check(self) -> None:
        """The rank is this process: alive while this runs."""

    @on_own_device
    def control(self, message: ControlMessage) -> list[Message]:
        """Answer a control message (one rank: one answer)."""
        if self.stage is None:
            raise RuntimeError("this instance has been shut down")
        return [handle_control(self.stage, self.graph, self.role, 0, message)]

    @on_own_device
    def shutdown(self) -> None:
        if self.stage is not None:
            self.stage.release()
            self.stage = None
        self._done.clear()
        self._samples = None


class MultiProcessExecutor:
    """Starts one process per rank of ``role`` (the launcher is swappable), sends every
    rank each step, and waits for the sampling rank's answer while watching all ranks.

    Up to ``depth`` steps are in flight, by default one per pipeline stage
    (``ParallelSpec.max_steps_in_flight``): stage 0 starts step k+1 while stage 1 runs
    step k (ranks take their steps in order, so a step's K/V writes at a stage land before
    any later step reads them). Answers come back in step order.
    """

    overlap = False  # steps carry known tokens only (the graph refuses overlap here)

    def __init__(self, graph: RunGraph, role: str, launcher: Launcher | None = None):
        spec = graph.raise_if_refused().spec
        plan = graph.instance(role)
        par = parallel_of(spec, role)
        self.step_timeout_s = par.step_timeout_s
        self.driver = driver_rank(plan)
        self.depth = par.steps_in_flight
        self.launcher = launcher or LocalLauncher(spec, role, RANK_TARGET, [r.label for r in plan.ranks])
        self.launcher.start()
        self.world_size = len(plan.ranks)
        self.ready_timeout_s = par.ready_timeout_s
        # Steps submitted, oldest first: (step number, whether every rank answers ExportDone).
        self._pending: deque[tuple[int, bool]] = deque()
        self.max_in_flight = 0  # the most steps ever in flight at once (reported, tested)

    @property
    def pids(self) -> list[int]:
        return self.launcher.pids

    def submit(self, step: StepInput) -> None:
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"{self.depth} steps already in flight; collect one first")
        self.launcher.broadcast(step)
        self._pending.append((step.step, bool(step.exports)))
        self.max_in_flight = max(self.max_in_flight, len(self._pending))

    def collect(self) -> StepOutput:
        """The oldest step's answer (the timeout runs per step, from when it is awaited)."""
        want, exports = self._pending.popleft()
        failed: dict[str, str] = {}
        if exports:  # every rank reports its writes (the driver before its StepOutput)
            for rank in range(self.world_size):
                done = self.launcher.recv(rank, self.step_timeout_s)
                if not isinstance(done, ExportDone) or done.step != want:
                    raise RuntimeError(f"expected ExportDone for step {want} from rank {rank}, got {done!r:.200}")
                failed.update(done.failed)
        out = self.launcher.recv(self.driver, self.step_timeout_s)
        if not isinstance(out, StepOutput) or out.step != want:
            raise RuntimeError(f"expected StepOutput for step {want}, got {out!r:.200}")
        out.export_failed = failed
        return out

    def check(self) -> None:
        """Raise RankFailed if any rank has died (the instance is then torn down)."""
        self.launcher.check()

    def control(self, message: ControlMessage) -> list[Message]:
        """Send a control message to every rank between steps; one answer per rank."""
        if self._pending:
            raise RuntimeError("control messages go between steps; collect the steps in flight first")
        self.launcher.broadcast(message)
        return [self.launcher.recv(rank, self.ready_timeout_s) for rank in range(self.world_size)]

    def execute(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.collect()

    def shutdown(self) -> None:
        self.launcher.shutdown()
