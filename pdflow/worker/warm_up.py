"""A rank's start-up warm-up: everything its steps would compile happens before it answers
ready, so the first request of a cold start runs as fast as the hundredth.

Why: Triton compiles a kernel once per specialization (its constexprs, and the class of
each integer argument: 1, a multiple of 16, anything else), the decode graphs are captured
per batch bucket, and the CPU decode op is loaded (built, the first time) on first use.
Left lazy, a cold start paid them inside requests: a first ``pdflow run`` had arith TTFT
p50 21 s against 3.6 s on the second (CPU), needle 13 s against 0.17 s (one H200).

The warm-up runs one step of every shape class the engine schedules (``shape_classes``)
through the rank's real path (``StageRunner.tensors``: rows-as-decode included), every
slot -1 so nothing is written, then captures the graphs. Every TP peer of a stage runs it
together (the steps all-reduce). The owner builds the CPU op before it starts any rank
(``prebuild``), so ranks only load it and never race for one build.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from pdflow.attention import cpu_decode, jit_build
from pdflow.graph import RunGraph, parallel_of
from pdflow.model import layers
from pdflow.parallel.messages import SamplingSpec, StepInput
from pdflow.worker.stage_runner import ROWS_AS_DECODE, SHORT_STEP_ROWS


@dataclass(kw_only=True, slots=True, frozen=True)
class ShapeClass:
    """One step shape: new tokens and context length per sequence."""

    name: str
    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    # Drafts at the tail of each sequence's rows (a verify of [anchor, drafts]).
    drafts: int = 0


def decode_batches(max_rows: int, split_of, *, eager_from: int = 1) -> list[int]:
    """Decode batch sizes (rows) that between them meet every integer class of the row
    count (1, odd, a multiple of 16) and every split count ``split_of(rows)`` the decode
    kernel picks (a constexpr: one compile each) for the rows that run eagerly: from
    ``eager_from`` (smaller batches replay a captured graph) up to ``max_rows``."""
    sizes = {b for b in (1, 3, 16) if b <= max_rows}
    seen: set[int] = set()
    for b in range(eager_from, max_rows + 1):
        if (s := split_of(b)) not in seen:
            seen.add(s)
            sizes.add(b)
    return sorted(sizes)


def shape_classes(tokens: int, *, max_num_seqs: int, split_of=None, num_drafts: int = 0,
                  prefill_breaks: tuple[int, ...] = (), max_step_tokens: int | None = None) -> list[ShapeClass]:
    """What a rank's steps can look like, within ``tokens`` new tokens a step (contexts
    too: the pool holds them). On CPU
    (``split_of`` None) only the decode op compiles: one decode step loads it. On a GPU:
    a long prefill (the %16 class), a chunk after a prefix and a two-sequence prefill (odd
    lengths), a short step and a verify (rows as decode), and decode batches: one per
    split count of the decode kernel from one row up (short steps bring up to
    SHORT_STEP_ROWS rows). With ``num_drafts`` k, the verify is
    [anchor, k drafts]. ``prefill_breaks``: prompt lengths from which the prefill kernel is
    another compile (``kernels/prefill_auto.length_breaks``): a side of a break that no
    prefill above meets gets one of its own (both integer classes, up to
    ``max_step_tokens``, the longest prompt part a step carries), however far past
    ``tokens`` (its steps write nothing; their tables wrap the pool)."""
    n = max(1, tokens)
    if split_of is None:
        return [ShapeClass(name="decode", q_lens=(1,), context_lens=(n,))]
    odd = n - 1 if n % 2 == 0 else n
    classes = [
        ShapeClass(name=f"prefill {n}", q_lens=(n,), context_lens=(n,)),
        ShapeClass(name=f"prefill chunk {odd} after a prefix", q_lens=(odd,), context_lens=(n,)),
    ]
    if n // 2 > SHORT_STEP_ROWS:
        half = n // 2 - 1 - (n // 2) % 2  # odd, and the pair stays above SHORT_STEP_ROWS
        classes.append(ShapeClass(name=f"prefill 2 x {half}", q_lens=(half, half), context_lens=(half, n)))
    classes += _around_breaks(classes, prefill_breaks, max_step_tokens or n)
    short = min(n, SHORT_STEP_ROWS) - 1 or 1
    classes.append(ShapeClass(name=f"short step {short}", q_lens=(short,), context_lens=(n,)))
    verify = min(n, num_drafts + 1 if num_drafts else ROWS_AS_DECODE)
    classes.append(ShapeClass(name=f"verify {verify} rows", q_lens=(verify,), context_lens=(n,),
                              drafts=verify - 1 if num_drafts else 0))
    # A verify of every sequence runs k+1 rows each as decode; a step holds at most n tokens.
    rows = min(n, max(max_num_seqs * (num_drafts + 1), SHORT_STEP_ROWS))
    # From one row, not from past the graphs: a verify, a mixed or a sampled step runs its
    # rows eagerly at any count, and the graphs' capture compiled only their buckets' splits
    # (seen on an H200: split counts 9, 10 and 14 compiled inside requests with DSpark).
    for b in decode_batches(rows, split_of, eager_from=1):
        lens = tuple(max(1, n - 7 * i) for i in range(b))
        classes.append(ShapeClass(name=f"decode batch {b}", q_lens=(1,) * b, context_lens=lens))
    return classes


def _around_breaks(prefills: list[ShapeClass], breaks: tuple[int, ...], budget: int) -> list[ShapeClass]:
    """For each break: prefills of ``break - 16`` and ``break - 1`` tokens when no prefill in
    ``prefills`` is below it (past a short step), of ``break`` and ``break + 1`` when none
    reaches it. The warm-up's own prefills stop at 512 tokens (``stage.WARM_UP_TOKENS``),
    and the d64 Gluon kernel takes three warpgroups from 4,096: without these, the first
    such prompt compiled it inside a request."""
    longest = [max(c.q_lens) for c in prefills]
    extra = []
    for b in breaks:
        if b - 16 <= SHORT_STEP_ROWS or b > budget:
            continue
        sides = []
        if not any(SHORT_STEP_ROWS < n < b for n in longest):
            sides += [b - 16, b - 1]
        if not any(n >= b for n in longest):
            sides += [b, b + 1]
        for q in (q for q in sides if q <= budget):  # the odd length as a chunk after a prefix
            extra.append(ShapeClass(name=f"prefill {q} (a kernel length break at {b})", q_lens=(q,),
                                    context_lens=(min(q + 16 * (q % 2), budget),)))
    return extra


def warm_step(shape: ShapeClass, block_size: int, number: int, *, num_blocks: int,
              lookahead: int = 0) -> StepInput:
    """The step of ``shape``: positions at the tail of each context, every slot -1 (no
    K/V is written), block tables over the pool's first blocks (wrapping within its
    ``num_blocks``), covering ``lookahead`` positions past the context (where a drafter's
    proposal writes, as the scheduler reserves them), the last row sampled; for
    a drafter, the context before the rows adopted (held in the pool) and released at
    the next step."""
    ids, positions, cu, tables = [], [], [0], []
    for q, ctx in zip(shape.q_lens, shape.context_lens, strict=True):
        positions += range(ctx - q, ctx)
        ids += [0] * q
        cu.append(cu[-1] + q)
        tables.append([b % num_blocks for b in range(-(-(ctx + lookahead) // block_size))])
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    seqs = [f"warm-up-{i}" for i in range(len(shape.q_lens))]
    return StepInput(step=-1 - number, seq_ids=seqs, token_ids=ids, positions=positions,
                     slot_mapping=[-1] * len(ids), cu_seqlens_q=cu, context_lens=list(shape.context_lens),
                     block_tables=tables, sample_rows=[c - 1 for c in cu[1:]], sample_seq_ids=seqs,
                     sampling=[SamplingSpec() for _ in seqs],
                     num_drafts=[shape.drafts] * len(seqs) if shape.drafts else [],
                     next_token_ids=[-1] * len(seqs),
                     context_adopt=[ctx - q for q, ctx in zip(shape.q_lens, shape.context_lens, strict=True)])


@torch.inference_mode()
def warm_up(stage, *, announce: str | None = None, full: bool | None = None) -> float:
    """Run every shape class through ``stage`` (its drafter's part too), then capture its
    graphs; the seconds it took. ``announce``: a label for counted progress lines on
    stderr (one rank per instance says them). ``full``: the GPU's classes (default: on a
    GPU; on CPU only the decode op compiles, and one decode step loads it)."""
    began = time.monotonic()
    device = stage.runner.device
    if not stage.warm_tokens:
        return 0.0
    cuda = device.type == "cuda"
    full = cuda if full is None else full
    if not full and not uses_cpu_op(stage):
        return 0.0
    split_of, breaks = None, ()
    if full:
        from pdflow.kernels.decode_attention import default_splits

        # Every KV head count the stage's attention runs with (the target's, a drafter's):
        # a batch size is a new class when any of their split counts changes.
        h_kvs = sorted({cache.shape[2] for cache in stage.kv.caches.values()})
        split_of = lambda b: tuple(default_splits(b, h, device, None) for h in h_kvs)  # noqa: E731
        from pdflow.kernels.prefill_auto import length_breaks

        breaks = tuple(sorted({b for c in stage.kv.caches.values() for b in length_breaks(c.shape[-1], c.dtype)}))
    block = stage.kv.units[next(iter(stage.kv.units))].block_size
    # Contexts stay within warm_tokens, which the pool holds (build_stage caps it), but for
    # the prefills at the prefill kernel's length breaks: their tables wrap the pool.
    classes = shape_classes(stage.warm_tokens, max_num_seqs=stage.max_num_seqs, split_of=split_of,
                            num_drafts=stage.drafting.num_drafts if stage.drafting is not None else 0,
                            prefill_breaks=breaks, max_step_tokens=stage.max_step_tokens)
    total = len(classes) + sum(g is not None for g in (stage.graphs, stage.drafted_graphs, stage.piecewise))
    dtype = next(stage.model.parameters()).dtype
    log_event("warm_up_begin", announce)
    for i, shape in enumerate(classes):
        _say(announce, i + 1, total, shape.name)
        step = warm_step(shape, block, i, num_blocks=stage.kv.num_blocks,
                         lookahead=stage.drafting.num_drafts + 1 if stage.drafting is not None else 0)
        ids, positions, meta = stage.runner.tensors(step)
        n = len(step.token_ids)
        inputs = ids if stage.hidden_in is None else torch.zeros(n, stage.hidden_in, dtype=dtype, device=device)
        taps = (torch.zeros(n, stage.relayed_in * stage.hidden_in, dtype=dtype, device=device)
                if stage.relayed_in else None)
        hidden, taps_out = stage.runner.forward(inputs, positions, meta, taps)
        if full and stage.drafting is not None:  # its eager step: context write, verify, propose
            stage.draft(step, ids, positions, meta, hidden, taps_out)
            stage.drafting.release(step.seq_ids)
        elif stage.model.lm_head is not None:
            stage.runner.logits(step, hidden)
    if full and cuda:  # the steps above met each small fp32 product in one row class
        layers.warm_small_m_row_classes(device)
    done = len(classes)
    if stage.graphs is not None:
        done += 1
        _say(announce, done, total, "capturing decode graphs")
        stage.graphs.capture()
    if stage.drafted_graphs is not None:
        done += 1
        _say(announce, done, total, "capturing drafted-step graphs")
        try:
            stage.drafted_graphs.capture()
        except Exception as exc:  # a drafted step that cannot be captured costs speed only
            warnings.warn(f"drafted steps run eagerly: capturing them failed ({type(exc).__name__}: "
                          f"{str(exc)[:300]})", RuntimeWarning, stacklevel=2)
            stage.drafted_graphs.release()
            stage.drafted_graphs = None
    if stage.piecewise is not None:
        done += 1
        _say(announce, done, total, "capturing prefill graphs")
        try:
            stage.piecewise.capture()
        except Exception as exc:  # costs speed only: prefill steps run eagerly
            warnings.warn(f"prefill steps run eagerly: capturing them in pieces failed ({type(exc).__name__}: "
                          f"{str(exc)[:300]})", RuntimeWarning, stacklevel=2)
            stage.piecewise.release()
            stage.piecewise = None
    if cuda:
        torch.cuda.synchronize(device)
    log_event("warm_up_end", announce)
    return time.monotonic() - began


def uses_cpu_op(stage) -> bool:
    """Whether this CPU stage's decode steps run the compiled op (torch backend, fp32):
    the only thing that compiles on CPU."""
    attn = stage.model.attention_layers()
    return (cpu_decode.enabled() and bool(attn) and attn[0].backend.name == "torch"
            and next(iter(stage.kv.caches.values())).dtype == torch.float32)


def _say(label: str | None, i: int, total: int, what: str) -> None:
    if label is not None:
        jit_build.say(f"pdflow: {label} warm-up {i}/{total}: {what}")


def log_event(event: str, label: str | None = None) -> None:
    """Append ``event`` to ``$PDFLOW_COMPILE_LOG`` when set (tests: what loaded or warmed
    up, and when, across every rank process)."""
    jit_build.log_event(event, what=label or "")


def prebuild(graph: RunGraph, role: str) -> float:
    """In the owner, before any rank starts: build (or load) the CPU decode op when a rank
    of ``role`` will use it, so ranks load a finished build instead of racing to compile
    it mid-workload. The seconds it took."""
    par = parallel_of(graph.spec, role)
    if par.device != "cpu" or graph.spec.model.dtype != "fp32" or not cpu_decode.enabled():
        return 0.0
    began = time.monotonic()
    cpu_decode.op()
    return time.monotonic() - began


def compile_seconds(prebuild_s: float, rank_warm_up_s: list[float]) -> float:
    """An instance's compile time: the owner's build, then its ranks' warm-ups (they run
    at once: the slowest counts)."""
    return prebuild_s + max(rank_warm_up_s, default=0.0)

