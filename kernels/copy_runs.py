"""Many byte runs copied in one launch: the P/D transfer's pack and scatter.

A request's head cut is thousands of runs (every unit, block and page of the heads one
consumer rank holds); gathering them with one torch op per unit pays a launch and a host
round trip per unit. Here a table of (address a, address b, length in 8-byte words) on the
device drives one kernel: program (i, j) copies slice j of run i from ``a`` to
``b + shift`` (or, ``reverse``, from ``b + shift`` to ``a``). With ``b`` a run's offset in
the packed stream and ``shift`` a buffer's address less the chunk's first offset, one
table built once per request serves every chunk's pack and scatter (a slice of it per
chunk, nothing rebuilt on the host); with ``b`` an absolute address and ``shift`` 0 it is
a plain gather-scatter (a producer writing straight into a consumer's caches).
``copy_plan`` computes each row in the kernel instead, from a cut plan's per-group
constants and the request's block ids, so a request builds no table at all.
``copy_runs_reference`` is the same copy on the host (CPU tensors), for tests.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
import triton
import triton.language as tl

WORD = 8  # bytes per element copied: every run's address and length is a multiple of it


@triton.jit
def _copy_words(a, b, words, part, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """Slice ``part`` (up to BLOCK words) of a run of ``words`` words from address ``a`` to
    ``b`` (``REVERSE``: back)."""
    if REVERSE:
        src, dst = b.to(tl.pointer_type(tl.int64)), a.to(tl.pointer_type(tl.int64))
    else:
        src, dst = a.to(tl.pointer_type(tl.int64)), b.to(tl.pointer_type(tl.int64))
    offs = part * BLOCK + tl.arange(0, BLOCK)
    keep = offs < words
    tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)


@triton.jit
def _copy_slice(table_ptr, shift, run, part, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """Slice ``part`` of run ``run`` of the table."""
    row = table_ptr + run * 3
    _copy_words(tl.load(row), tl.load(row + 1) + shift, tl.load(row + 2), part, BLOCK, REVERSE)


@triton.jit
def _copy_runs_kernel(table_ptr, shift, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    _copy_slice(table_ptr, shift, tl.program_id(0), tl.program_id(1), BLOCK, REVERSE)


@triton.jit
def _copy_runs_strided_kernel(table_ptr, shift, n_slices, parts, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """A fixed number of programs, each walking slices (run, part) with the grid's stride."""
    for idx in range(tl.program_id(0), n_slices, tl.num_programs(0)):
        _copy_slice(table_ptr, shift, idx // parts, idx % parts, BLOCK, REVERSE)


def _slices(max_words: int) -> tuple[int, int]:
    """(words per program, programs per run) for runs of at most ``max_words`` words."""
    block = min(2048, triton.next_power_of_2(max(max_words, 16)))
    return block, triton.cdiv(max_words, block)


def copy_runs(table: torch.Tensor, max_words: int, *, shift: int = 0, reverse: bool = False,
              programs: int = 0) -> None:
    """Copy every run of ``table`` (int64 [n, 3], contiguous rows, on the device that
    launches: a, b, length in words) from ``a`` to ``b + shift`` (``reverse``: back);
    ``max_words`` bounds the lengths. ``programs`` > 0 caps the launch at that many
    programs (each walks slices with the grid's stride), so a pack running beside an NCCL
    transfer leaves it SMs and memory bandwidth; 0: one program per slice."""
    if table.numel() == 0:
        return
    if table.stride() != (3, 1):
        raise ValueError("copy_runs takes a table of contiguous [n, 3] rows")
    block, parts = _slices(max_words)
    with torch.cuda.device(table.device) if table.is_cuda else contextlib.nullcontext():  # Triton: current device
        if programs > 0:
            n_slices = table.shape[0] * parts
            _copy_runs_strided_kernel[(min(programs, n_slices),)](table, shift, n_slices, parts, BLOCK=block,
                                                                   REVERSE=reverse)
        else:
            _copy_runs_kernel[(table.shape[0], parts)](table, shift, BLOCK=block, REVERSE=reverse)


# Per group of a cut plan, what ``copy_plan`` reads (int64): units, runs per block, packed
# bytes per (unit, block), and the addresses of four int64 arrays: each (unit, run)'s
# address in block 0 ([units, runs]), each unit's block stride ([units]), each run's
# length in words and its offset in one block's packed runs ([runs] each).
PLAN_FIELDS = 7


@triton.jit
def _plan_row(plan_ptr, ids_ptr, k, r, GROUPS: tl.constexpr):
    """Row ``r`` of a request of ``k`` blocks in packing's order (group, unit, block, run):
    its address on this side, its offset in the packed stream, its length in words."""
    zero = r * 0
    row_start, byte_start = zero, zero
    base, stride, offset, words, index = zero, zero, zero, zero, zero
    for g in tl.static_range(GROUPS):
        d = plan_ptr + g * 7
        units, runs, per_block = tl.load(d), tl.load(d + 1), tl.load(d + 2)
        n = units * k * runs
        local = tl.minimum(tl.maximum(r - row_start, 0), n - 1)  # in range for every group
        unit, kk, run = local // (k * runs), (local // runs) % k, local % runs
        inside = (r >= row_start) & (r < row_start + n)
        first = tl.load(tl.load(d + 3).to(tl.pointer_type(tl.int64)) + unit * runs + run)
        base = tl.where(inside, first, base)
        stride = tl.where(inside, tl.load(tl.load(d + 4).to(tl.pointer_type(tl.int64)) + unit), stride)
        words = tl.where(inside, tl.load(tl.load(d + 5).to(tl.pointer_type(tl.int64)) + run), words)
        prefix = tl.load(tl.load(d + 6).to(tl.pointer_type(tl.int64)) + run)
        offset = tl.where(inside, byte_start + (unit * k + kk) * per_block + prefix, offset)
        index = tl.where(inside, kk, index)
        row_start += n
        byte_start += units * k * per_block
    block = tl.load(ids_ptr.to(tl.pointer_type(tl.int64)) + index)
    return base + block * stride, offset, words


@triton.jit
def _copy_plan_slice(plan_ptr, ids_ptr, k, r, part, shift, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                     REVERSE: tl.constexpr):
    a, b, words = _plan_row(plan_ptr, ids_ptr, k, r, GROUPS)
    _copy_words(a, b + shift, words, part, BLOCK, REVERSE)


# One compile per (groups, block, direction): a request's numbers are not specialized on
# (a 1-block request, or an offset divisible by 16, would each compile anew on its path).
@triton.jit(do_not_specialize=["ids_ptr", "k", "first", "shift"])
def _copy_plan_kernel(plan_ptr, ids_ptr, k, first, shift, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                      REVERSE: tl.constexpr):
    r = first + tl.program_id(0).to(tl.int64)
    _copy_plan_slice(plan_ptr, ids_ptr, k, r, tl.program_id(1), shift, GROUPS, BLOCK, REVERSE)


@triton.jit(do_not_specialize=["ids_ptr", "k", "first", "shift", "n_slices", "parts"])
def _copy_plan_strided_kernel(plan_ptr, ids_ptr, k, first, shift, n_slices, parts, GROUPS: tl.constexpr,
                              BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    for idx in range(tl.program_id(0), n_slices, tl.num_programs(0)):
        r = (first + idx // parts).to(tl.int64)
        _copy_plan_slice(plan_ptr, ids_ptr, k, r, idx % parts, shift, GROUPS, BLOCK, REVERSE)


def copy_plan(plan: torch.Tensor, ids: torch.Tensor, k: int, first: int, stop: int, max_words: int, *,
              shift: int = 0, reverse: bool = False, programs: int = 0) -> None:
    """``copy_runs`` over rows [first, stop) of a request of ``k`` blocks, each row computed
    in the kernel from ``plan`` (int64 [groups, PLAN_FIELDS] on the launching device: a cut
    plan's per-group constants) and the block ids ``ids`` (int64, on that device). Nothing
    is built per request: the request writes its block ids and launches. Row r copies from
    the run's address to its stream offset + ``shift`` (``reverse``: back)."""
    if stop <= first or k <= 0:
        return
    if plan.dim() != 2 or plan.shape[1] != PLAN_FIELDS or not plan.is_contiguous():
        raise ValueError(f"copy_plan takes a contiguous [groups, {PLAN_FIELDS}] plan")
    block, parts = _slices(max_words)
    groups = plan.shape[0]
    with torch.cuda.device(plan.device) if plan.is_cuda else contextlib.nullcontext():  # Triton: current device
        if programs > 0:
            n_slices = (stop - first) * parts
            _copy_plan_strided_kernel[(min(programs, n_slices),)](plan, ids.data_ptr(), k, first, shift, n_slices,
                                                                   parts, GROUPS=groups, BLOCK=block, REVERSE=reverse)
        else:
            _copy_plan_kernel[(stop - first, parts)](plan, ids.data_ptr(), k, first, shift, GROUPS=groups, BLOCK=block,
                                                     REVERSE=reverse)


def compile_copies(device: torch.device, max_words: int, *, groups: int | None, reverse: bool,
                   programs: int = 0) -> None:
    """Compile, without running, what a pair's copies will launch on ``device``: ``copy_plan``
    for a plan of ``groups`` rows (its integers are not specialized: one compile), or with
    ``groups`` None ``copy_runs`` (the strided form for each integer class of its slice
    count: 1, x16, other). Why: a pair's first request otherwise waits on Triton."""
    block, parts = _slices(max(max_words, 1))
    big = 1 << 40  # an address: typed int64 like a real one
    with torch.cuda.device(device):
        if groups is not None:
            plan = torch.zeros(groups, PLAN_FIELDS, dtype=torch.int64, device=device)
            if programs > 0:
                _loaded(_copy_plan_strided_kernel.warmup(plan, big, 2, 2, big, 2, parts, GROUPS=groups, BLOCK=block,
                                                         REVERSE=reverse, grid=(1,)))
            else:
                _loaded(_copy_plan_kernel.warmup(plan, big, 2, 2, big, GROUPS=groups, BLOCK=block, REVERSE=reverse,
                                                 grid=(1, 1)))
            return
        table = torch.zeros(1, 3, dtype=torch.int64, device=device)
        if programs > 0:
            for n_slices in {parts, 16 * parts, 3 * parts}:
                _loaded(_copy_runs_strided_kernel.warmup(table, 0, n_slices, parts, BLOCK=block, REVERSE=reverse,
                                                         grid=(1,)))
        else:
            _loaded(_copy_runs_kernel.warmup(table, 0, BLOCK=block, REVERSE=reverse, grid=(1, 1)))


def _loaded(compiled) -> None:
    """Load a compiled kernel and build its launcher now: ``warmup`` compiles only, and the
    launcher (a small C extension) was otherwise built at the first request's launch."""
    init = getattr(compiled, "_init_handles", None)  # Triton's own lazy loader
    if init is not None:
        init()


def copy_runs_reference(table: torch.Tensor, *, shift: int = 0, reverse: bool = False) -> None:
    """The same copy with memmove (host memory only)."""
    for a, b, words in table.tolist():
        src, dst = (b + shift, a) if reverse else (a, b + shift)
        ctypes.memmove(dst, src, words * WORD)
