"""What each step of a one-process instance ran, for the speed scripts: which attention
path (prefill tiles, decode, decode rows), how many rows, whether a CUDA graph replayed
it (and, for a step that verified drafts, whether the whole drafted step did: verify,
context write and proposal), which attention ops ran eagerly (a replayed graph calls
none), its wall time, and
how many Triton kernels were built (compiled or loaded) meanwhile, so one GPU run shows
whether a timing held a compile or a step the warm-up never took.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from pdflow.engine.llm_engine import LLMEngine
from pdflow.parallel.messages import StepInput
from pdflow.worker.executors import InProcessExecutor
from pdflow.worker.stage_runner import runs_as_decode_rows

# The attention backend's entry points a step can reach (target layers and drafter).
OPS = ("prefill_attention", "decode_attention", "block_attention", "store_kv")


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    seqs: int
    rows: int
    longest: int
    path: str  # prefill | decode | decode-rows
    graphed: bool
    ms: float
    ops: dict[str, int] = field(default_factory=dict)
    drafted: bool = False  # the step verified drafts
    drafted_graph: bool = False  # ... and ran whole through the drafted-step graphs

    def line(self) -> str:
        ops = " ".join(f"{k.split('_')[0]}={v}" for k, v in sorted(self.ops.items())) or "none"
        how = "drafted graph" if self.drafted_graph else ("graphed" if self.graphed else "eager")
        return (f"step {self.step}: {self.path} {self.seqs} seqs {self.rows} rows (longest {self.longest}), "
                f"{how}, {self.ms:.2f} ms, eager attention ops: {ops}")


def step_path(step: StepInput, *, short_steps: bool = True) -> tuple[str, int, int]:
    """(path, rows, longest) the stage runner takes for ``step`` (``short_steps``: as
    ``runs_as_decode_rows``, False on the CPU)."""
    q_lens = [b - a for a, b in itertools.pairwise(step.cu_seqlens_q)]
    longest = max(q_lens, default=0)
    if runs_as_decode_rows(q_lens, short_steps=short_steps):
        return "decode-rows", sum(q_lens), longest
    return ("decode" if longest == 1 else "prefill"), sum(q_lens), longest


def triton_kernels_built() -> int | None:
    """Kernels pdflow.kernels' Triton functions hold for any device so far; None under
    the interpreter (nothing is compiled there)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    seen, total = set(), 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("pdflow.kernels") or module is None:
            continue
        for obj in vars(module).values():
            if isinstance(obj, JITFunction) and id(obj) not in seen:
                seen.add(id(obj))
                total += sum(len(caches[0]) for caches in getattr(obj, "device_caches", {}).values())
    return total if seen else None


class StepTrace:
    """Records every step ``engine`` runs while attached (its instance must run in this
    process). Use as a context manager; ``records`` keeps the steps, oldest first."""

    def __init__(self, engine: LLMEngine):
        executor = engine.instance.executor
        if not isinstance(executor, InProcessExecutor) or executor.stage is None:
            raise TypeError("StepTrace needs an instance that runs in this process (tp=1, pp=1)")
        if executor.overlap:
            raise TypeError("StepTrace times whole steps; overlap scheduling launches them and "
                            "returns: set the side's overlap_scheduling=false to trace")
        self.executor = executor
        self.backends = {id(a.backend): a.backend for a in executor.stage.model.attention_layers()}
        self.records: list[StepRecord] = []
        self.kernels_before: int | None = None
        self._counts: Counter[str] = Counter()

    def __enter__(self) -> StepTrace:
        self.kernels_before = triton_kernels_built()
        for backend in self.backends.values():
            for name in OPS:
                op = getattr(backend, name, None)
                if op is not None:
                    setattr(backend, name, self._counting(name, op))
        self.executor.execute = self._execute
        return self

    def __exit__(self, *exc) -> None:
        del self.executor.execute  # the class's method again
        for backend in self.backends.values():
            for name in OPS:
                if name in vars(backend):
                    delattr(backend, name)

    def _counting(self, name: str, op):
        def counted(*args, **kwargs):
            self._counts[name] += 1
            return op(*args, **kwargs)
        return counted

    def _execute(self, step: StepInput):
        self._counts.clear()
        replays = self._drafted_replays()
        start = time.perf_counter()
        out = InProcessExecutor.execute(self.executor, step)
        ms = 1e3 * (time.perf_counter() - start)
        path, rows, longest = step_path(step, short_steps=self.executor.stage.runner.short_steps)
        self.records.append(StepRecord(step=step.step, seqs=len(step.seq_ids), rows=rows, longest=longest,
                                       path=path, graphed=out.cuda_graph, ms=ms, ops=dict(self._counts),
                                       drafted=any(step.num_drafts),
                                       drafted_graph=self._drafted_replays() > replays))
        return out

    def _drafted_replays(self) -> int:
        stage = self.executor.stage
        runner = None if stage is None else stage.drafted_graphs
        return 0 if runner is None else runner.replays

    def kernels_built(self) -> int | None:
        """Triton kernels built since attaching (None under the interpreter)."""
        now = triton_kernels_built()
        return None if now is None or self.kernels_before is None else now - self.kernels_before

    def summary(self) -> str:
        """One line: steps, graphed, steps per path, eager op calls, kernels built, slowest step."""
        recs = self.records
        if not recs:
            return "no steps"
        paths = Counter(r.path for r in recs)
        graphed = Counter(r.path for r in recs if r.graphed)
        ops = Counter()
        for r in recs:
            ops.update(r.ops)
        slow = max(recs, key=lambda r: r.ms)
        built = self.kernels_built()
        return (f"{len(recs)} steps ({sum(r.graphed for r in recs)} graphed); "
                + ", ".join(f"{p} x{n} ({graphed[p]} graphed)" for p, n in sorted(paths.items()))
                + f"; drafted steps: {sum(r.drafted for r in recs)} "
                + f"({sum(r.drafted_graph for r in recs)} in drafted graphs)"
                + "; eager attention ops: " + (" ".join(f"{k}={v}" for k, v in sorted(ops.items())) or "none")
                + f"; triton kernels built: {'n/a' if built is None else built}"
                + f"; slowest: {slow.path} {slow.rows} rows {'graphed' if slow.graphed else 'eager'} {slow.ms:.1f} ms")
