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
def _copy_slice(table_ptr, shift, run, part, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """Slice ``part`` of run ``run``: up to BLOCK words."""
    a = tl.load(table_ptr + run * 3)
    b = tl.load(table_ptr + run * 3 + 1) + shift
    if REVERSE:
        src, dst = b.to(tl.pointer_type(tl.int64)), a.to(tl.pointer_type(tl.int64))
    else:
        src, dst = a.to(tl.pointer_type(tl.int64)), b.to(tl.pointer_type(tl.int64))
    words = tl.load(table_ptr + run * 3 + 2)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    keep = offs < words
    tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)


@triton.jit
def _copy_runs_kernel(table_ptr, shift, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    _copy_slice(table_ptr, shift, tl.program_id(0), tl.program_id(1), BLOCK, REVERSE)


@triton.jit
def _copy_runs_strided_kernel(table_ptr, shift, n_slices, parts, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """A fixed number of programs, each walking slices (run, part) with the grid's stride."""
    for idx in range(tl.program_id(0), n_slices, tl.num_programs(0)):
        _copy_slice(table_ptr, shift, idx // parts, idx % parts, BLOCK, REVERSE)


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
    block = min(2048, triton.next_power_of_2(max(max_words, 16)))
    parts = triton.cdiv(max_words, block)
    with torch.cuda.device(table.device) if table.is_cuda else contextlib.nullcontext():  # Triton: current device
        if programs > 0:
            n_slices = table.shape[0] * parts
            _copy_runs_strided_kernel[(min(programs, n_slices),)](table, shift, n_slices, parts, BLOCK=block,
                                                                   REVERSE=reverse)
        else:
            _copy_runs_kernel[(table.shape[0], parts)](table, shift, BLOCK=block, REVERSE=reverse)


def copy_runs_reference(table: torch.Tensor, *, shift: int = 0, reverse: bool = False) -> None:
    """The same copy with memmove (host memory only)."""
    for a, b, words in table.tolist():
        src, dst = (b + shift, a) if reverse else (a, b + shift)
        ctypes.memmove(dst, src, words * WORD)
