"""Many byte runs copied in one launch: the P/D transfer's pack and scatter.

A request's head cut is thousands of runs (every unit, block and page of the heads one
consumer rank holds); gathering them with one torch op per unit pays a launch and a host
round trip per unit. Here a table of (source address, destination address, length in
8-byte words) on the device drives one kernel: program (i, j) copies slice j of run i.
``copy_runs_reference`` is the same copy on the host (CPU tensors), for tests.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

WORD = 8  # bytes per element copied: every run's address and length is a multiple of it


@triton.jit
def _copy_runs_kernel(table_ptr, BLOCK: tl.constexpr):
    run = tl.program_id(0)
    part = tl.program_id(1)
    src = tl.load(table_ptr + run * 3).to(tl.pointer_type(tl.int64))
    dst = tl.load(table_ptr + run * 3 + 1).to(tl.pointer_type(tl.int64))
    words = tl.load(table_ptr + run * 3 + 2)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    keep = offs < words
    tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)


def copy_runs(table: torch.Tensor, max_words: int) -> None:
    """Copy every run of ``table`` (int64 [n, 3] on the device whose memory the addresses
    name: source, destination, length in words); ``max_words`` bounds the lengths."""
    if table.numel() == 0:
        return
    block = min(2048, triton.next_power_of_2(max(max_words, 16)))
    grid = (table.shape[0], triton.cdiv(max_words, block))
    if not table.is_cuda:  # the interpreter, on CPU tensors
        _copy_runs_kernel[grid](table, BLOCK=block)
        return
    with torch.cuda.device(table.device):  # Triton launches on the current device
        _copy_runs_kernel[grid](table, BLOCK=block)


def copy_runs_reference(table: torch.Tensor) -> None:
    """The same copy with memmove (host memory only)."""
    for src, dst, words in table.tolist():
        ctypes.memmove(dst, src, words * WORD)
