"""The one contract between an instance's owner and its workers.

The owner (scheduler, block manager) builds ``StepInput``s; an executor runs them on the
instance's ranks and hands back ``StepOutput``s in submission order. Two implementations
live in ``pdflow.worker.executors``: in this process (one rank) and one process per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from pdflow.graph import RunGraph, parallel_of
from pdflow.parallel.messages import ControlMessage, Message, StepInput, StepOutput
from pdflow.worker.executors import InProcessExecutor, MultiProcessExecutor


@runtime_checkable
class Executor(Protocol):
    # Steps that may be submitted before the oldest is collected (one per PP stage; two
    # under overlap scheduling).
    depth: int
    # Overlap scheduling: ``submit`` returns with the step's samples still on the device,
    # and the next step may name them as placeholders (StepInput.placeholder_rows).
    overlap: bool
    # Seconds spent compiling before the first step (the CPU op's build, rank warm-ups).
    compile_s: float
    # P/D producer: KV bytes its ranks moved, summed over their ``KVSent.nbytes``.
    kv_bytes_sent: int

    def submit(self, step: StepInput) -> None: ...

    def collect(self) -> StepOutput: ...

    def settled(self, wait_s: float = 0.0) -> dict[str, str | None]:
        """P/D producer: requests whose KV exports settled on every rank since the last
        call (None: landed, else why not). Exports leave with a step and settle off the
        forward, on a later step; waits up to ``wait_s`` for one when none has."""
        ...

    def on_settled(self, callback: Callable[[], None]) -> None:
        """P/D producer: call ``callback`` when an export settles, from another thread (the
        in-process sender's; for ranks of their own, a watch on their pipes, which only
        ``settled`` reads): the owner's loop waits for commands, not on ``settled``."""
        ...

    def control(self, message: ControlMessage) -> list[Message]:
        """Between steps: send a control message to every rank, one answer per rank."""
        ...

    def check(self) -> None:
        """Raise if a rank is gone, without waiting for a step (a liveness probe)."""
        ...

    def shutdown(self) -> None: ...


def make_executor(graph: RunGraph, role: str) -> Executor:
    """In process for a one-rank side, one process per rank otherwise."""
    if parallel_of(graph.spec, role).world_size == 1:
        return InProcessExecutor(graph, role)
    return MultiProcessExecutor(graph, role)
