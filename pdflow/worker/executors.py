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
from pdflow.parallel.messages import ControlMessage, KVSent, Message, StepInput, StepOutput
from pdflow.parallel.readable_watch import ReadableWatch
from pdflow.worker.control import handle_control
from pdflow.worker.overlap_step import LaunchedStep, launch
from pdflow.worker.stage import Stage, build_stage, rank_device
from pdflow.worker.warm_up import compile_seconds, prebuild

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
        # Seconds spent compiling before the first step (the CPU op's build, the warm-up).
        self.compile_s = 0.0
        self._build()
        self.overlap = overlap_scheduling(graph.spec, role)
        self.depth = 2 if self.overlap else 1
        self.kv_bytes_sent = 0  # P/D producer: KV bytes the rank moved (KVSent.nbytes)
        self._done: deque[StepOutput | LaunchedStep] = deque()
        # Overlap: the last launched step's number and its sampled tokens, on the device.
        self._samples: tuple[int, torch.Tensor] | None = None

    @on_own_device
    def _build(self) -> None:
        built_s = prebuild(self.graph, self.role)
        self.stage = build_stage(self.graph, self.role, 0, self.device)
        self.compile_s = compile_seconds(built_s, [self.stage.warm_up(announce=f"{self.role} instance")])

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
        if step.exports:  # handed to the sender; they settle later (``settled``)
            stage.export(step.exports)
        logits = stage.runner.logits(step, hidden) if drafted is None else None
        return stage.answer(step, logits, taps, graphed, drafted, stage.score_prompts(step, hidden))

    def on_settled(self, callback) -> None:
        """Call ``callback`` (no arguments, from the sender's thread) whenever an export
        settles: the serving loop of a prefill instance waits for commands, not on ``settled``."""
        if self.stage is not None:
            self.stage.on_settle = callback

    @on_own_device
    def settled(self, wait_s: float = 0.0) -> dict[str, str | None]:
        """Requests whose KV exports settled since the last call: None when they landed,
        else why not; waits up to ``wait_s`` for one when none has."""
        if self.stage is None:
            return {}
        sents = self.stage.settled(wait_s)
        self.kv_bytes_sent += sum(sent.nbytes for sent in sents)
        return {rid: sent.failed.get(rid) for sent in sents for rid in sent.request_ids}

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
        self.launcher = launcher or LocalLauncher(spec, role, RANK_TARGET, [r.label for r in plan.ranks],
                                                  devices=graph.devices)
        built_s = prebuild(graph, role)  # before any rank starts: they load it, never race to build it
        readies = self.launcher.start()
        # Seconds spent compiling before the first step: the build above, then the ranks'
        # warm-ups (at once: the slowest counts).
        self.compile_s = compile_seconds(built_s, [r.warm_up_s for r in readies])
        self.world_size = len(plan.ranks)
        self.ready_timeout_s = par.ready_timeout_s
        # Steps submitted, oldest first, and answers read early (while polling for KVSent).
        self._pending: deque[int] = deque()
        self._answers: deque[Message] = deque()
        # Exports handed to the ranks: request id -> ranks yet to report it, and why it
        # failed on some rank; then, settled on every rank, not yet taken by the owner.
        self._owed: dict[str, set[int]] = {}
        self._failed: dict[str, str] = {}
        self._settled: dict[str, str | None] = {}
        self.max_in_flight = 0  # the most steps ever in flight at once (reported, tested)
        self.kv_bytes_sent = 0  # P/D producer: KV bytes every rank moved (KVSent.nbytes)
        self._watch: ReadableWatch | None = None  # ``on_settled``'s: armed while exports are owed

    @property
    def pids(self) -> list[int]:
        return self.launcher.pids

    def submit(self, step: StepInput) -> None:
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"{self.depth} steps already in flight; collect one first")
        self.launcher.broadcast(step)
        for export in step.exports:  # every rank sends its units and reports (KVSent)
            self._owed[export.request_id] = set(range(self.world_size))
        if step.exports and self._watch is not None:
            self._watch.arm()
        self._pending.append(step.step)
        self.max_in_flight = max(self.max_in_flight, len(self._pending))

    def collect(self) -> StepOutput:
        """The oldest step's answer (the timeout runs per step, from when it is awaited)."""
        want = self._pending.popleft()
        out = self._answers.popleft() if self._answers else self._recv(self.driver, self.step_timeout_s)
        while isinstance(out, KVSent):
            out = self._recv(self.driver, self.step_timeout_s)
        if not isinstance(out, StepOutput) or out.step != want:
            raise RuntimeError(f"expected StepOutput for step {want}, got {out!r:.200}")
        return out

    def on_settled(self, callback) -> None:
        """Call ``callback`` (no arguments, from a watch thread) when a rank's pipe turns
        readable while exports are owed: the ranks report settled exports there, and only
        ``settled`` reads them, on the owner's thread (which the callback wakes). A later
        call replaces the callback, as in process."""
        if self._watch is not None:
            self._watch.callback = callback
            return
        self._watch = ReadableWatch(self.launcher.report_handles, callback)
        if self._owed:
            self._watch.arm()

    def settled(self, wait_s: float = 0.0) -> dict[str, str | None]:
        """Requests whose KV exports settled on every rank since the last call (None: they
        landed, else why not); waits up to ``wait_s`` for one when none has (a rank that
        does not report by then fails the instance, as a step would)."""
        for rank in range(self.world_size):
            while self.launcher.has_message(rank):
                msg = self._recv(rank, self.step_timeout_s)
                if not isinstance(msg, KVSent):
                    self._answers.append(msg)  # the driver's answer to a step in flight
        while not self._settled and self._owed and wait_s > 0:
            rank = min(next(iter(self._owed.values())))  # the oldest request's first laggard
            msg = self._recv(rank, wait_s)
            if not isinstance(msg, KVSent):
                self._answers.append(msg)
        if self._watch is not None and self._owed:  # what was there is read: wake on the next report
            self._watch.arm()
        elif self._watch is not None:
            self._watch.disarm()
        out, self._settled = self._settled, {}
        return out

    def _recv(self, rank: int, timeout_s: float) -> Message:
        """One message from ``rank``; a KVSent is tallied as it comes (and returned too)."""
        msg = self.launcher.recv(rank, timeout_s)
        if isinstance(msg, KVSent):
            self.kv_bytes_sent += msg.nbytes
            for rid in msg.request_ids:
                owed = self._owed.get(rid)
                if owed is None:
                    continue
                owed.discard(msg.rank)
                if rid in msg.failed:
                    self._failed.setdefault(rid, msg.failed[rid])
                if not owed:
                    del self._owed[rid]
                    self._settled[rid] = self._failed.pop(rid, None)
        return msg

    def check(self) -> None:
        """Raise RankFailed if any rank has died (the instance is then torn down)."""
        self.launcher.check()

    def control(self, message: ControlMessage) -> list[Message]:
        """Send a control message to every rank between steps; one answer per rank."""
        if self._pending:
            raise RuntimeError("control messages go between steps; collect the steps in flight first")
        self.launcher.broadcast(message)
        return [self._answer(rank) for rank in range(self.world_size)]

    def _answer(self, rank: int) -> Message:
        """``rank``'s answer to a control message (exports settling before it are tallied)."""
        msg = self._recv(rank, self.ready_timeout_s)
        while isinstance(msg, KVSent):
            msg = self._recv(rank, self.ready_timeout_s)
        return msg

    def execute(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.collect()

    def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self.launcher.shutdown()
