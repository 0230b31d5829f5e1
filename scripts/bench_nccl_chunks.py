#!/usr/bin/env python
"""What chunking costs ``transfer=nccl`` before any cut: a request of 128 MiB and 1 GiB
sent between two GPUs as back-to-back NCCL sends of 16-256 MiB chunks, and through the
pair's two-slot pipeline with a contiguous device copy standing in for the pack and the
scatter, each against one send of the whole (plus an 8-byte ack, as the pair acks) in the
same run. The ceiling ``bench_gpu_transfer.py``'s packed pairs can reach. A second table
runs the 1 GiB request's pipeline with the pairs' own copy kernel (``kernels/copy_runs``,
32 KiB runs gathered out of order, as a head cut's are) at several program caps
(``transfer.copy_programs``; 0: one program per run slice).

    python scripts/bench_nccl_chunks.py          # 2 GPUs
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 1 << 20
TOTALS = (128 * MiB, 1 << 30)
CHUNKS = (256 * MiB, 128 * MiB, 64 * MiB, 32 * MiB, 16 * MiB)
SLOT = 128 * MiB
RUN = 32 * 1024  # bytes of one run: a page-128 block's head slice is tens of KiB
PROGRAMS = (0, 528, 264, 132, 66, 33, 16)


def _timed(fn, reps: int = 5) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def out_of_order_runs(base: torch.Tensor, chunk: int) -> torch.Tensor:
    """(address in ``base``, offset in the chunk, words) of a chunk's ``RUN``-byte runs,
    taken out of order as a head cut's are: a ``copy_runs`` table on ``base``'s device."""
    n = chunk // RUN
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    return torch.stack([base.data_ptr() + order * RUN, torch.arange(n) * RUN,
                        torch.full((n,), RUN // 8)], dim=1).contiguous().to(base.device)


def ack(group, rank: int, flag: torch.Tensor) -> None:
    """Rank 1 tells rank 0 it is done (8 bytes), as a pair acks a request."""
    (group.recv([flag], 1, 0) if rank == 0 else group.send([flag], 0, 0)).wait()


def pipeline(group, rank: int, halves: list[torch.Tensor], n: int, pack, scatter, flag: torch.Tensor) -> None:
    """The pairs' two-slot pipeline for ``n`` chunks, rank 0 to rank 1: rank 0 packs chunk
    i+1 (``pack(i, half)``) while chunk i is on the wire; rank 1 receives chunk i+1 while
    chunk i is scattered (``scatter(i, half)``)."""
    if rank == 0:
        works = [None, None]
        for i in range(n):
            if works[i % 2] is not None:
                works[i % 2].wait()
            pack(i, halves[i % 2])
            works[i % 2] = group.send([halves[i % 2]], 1, 0)
    else:
        pending = {0: group.recv([halves[0]], 0, 0)}
        for i in range(n):
            if i + 1 < n:
                pending[i + 1] = group.recv([halves[(i + 1) % 2]], 0, 0)
            pending.pop(i).wait()
            scatter(i, halves[i % 2])
    ack(group, rank, flag)


def two_ranks(target, timeout_s: float):
    """Run ``target(rank, store_path, result)`` on GPUs 0 and 1; returns what rank 0 put."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, os.path.join(tmp, "store"), result)) for r in (0, 1)]
        for p in procs:
            p.start()
        out = result.get(timeout=timeout_s)
        for p in procs:
            p.join(30)
    return out


def _rank(rank: int, path: str, result) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = dist.ProcessGroupNCCL(dist.FileStore(path, 2), rank, 2, dist.ProcessGroupNCCL.Options())
    wire = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    caches = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # what the pack reads, the scatter writes
    slots = torch.empty(2 * SLOT, dtype=torch.uint8, device=dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)

    def plain(total: int, chunk: int) -> None:
        for i in range(total // chunk):
            part = wire[i * chunk:(i + 1) * chunk]
            group.send([part], 1, 0) if rank == 0 else group.recv([part], 0, 0)
        ack(group, rank, flag)

    tables: dict[int, torch.Tensor] = {}

    def copier(programs, chunk: int):
        """(pack, scatter) of chunk i: contiguous copies (None) or copy_runs over its runs."""
        if programs is None:
            return (lambda i, h: h.copy_(caches[i * chunk:(i + 1) * chunk]),
                    lambda i, h: caches[i * chunk:(i + 1) * chunk].copy_(h))
        from pdflow.kernels.copy_runs import copy_runs

        if chunk not in tables:  # built once per chunk size (in the warm-up), not per timed call
            tables[chunk] = out_of_order_runs(caches, chunk)
        table = tables[chunk]
        return (lambda i, h: copy_runs(table, RUN // 8, shift=h.data_ptr(), programs=programs),
                lambda i, h: copy_runs(table, RUN // 8, shift=h.data_ptr(), reverse=True, programs=programs))

    def piped(total: int, chunk: int, programs=None) -> None:
        pipeline(group, rank, [slots[:chunk], slots[SLOT:SLOT + chunk]], total // chunk, *copier(programs, chunk), flag)

    rows = []
    for total in TOTALS:
        for chunk in (total, *(c for c in CHUNKS if c < total)):
            t_plain = _timed(lambda t=total, c=chunk: plain(t, c))
            t_piped = _timed(lambda t=total, c=chunk: piped(t, c)) if chunk <= SLOT else float("nan")
            rows.append((total, chunk, total / t_plain / 1e9, total / t_piped / 1e9))
    kernel_rows = [(p, (1 << 30) / _timed(lambda p=p: piped(1 << 30, SLOT, p)) / 1e9) for p in PROGRAMS]
    if rank == 0:
        result.put((rows, kernel_rows))


def main() -> None:
    rows, kernel_rows = two_ranks(_rank, 300)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}: GPU 0 -> GPU 1")
    print("| request MiB | chunk MiB | sends | back to back GB/s | x one send | two-slot pipeline with copies GB/s "
          "| x one send |")
    print("|---|---|---|---|---|---|---|")
    one = {}
    for total, chunk, plain, piped in rows:
        one.setdefault(total, plain)  # the first row of each request is one send of the whole
        print(f"| {total // MiB} | {chunk // MiB} | {total // chunk} | {plain:.1f} | {plain / one[total]:.2f}x | "
              f"{piped:.1f} | {piped / one[total]:.2f}x |")
    print(f"\n1 GiB in {SLOT // MiB} MiB chunks, two-slot pipeline, pack and scatter by copy_runs over "
          f"{RUN // 1024} KiB runs:\n")
    print("| copy programs | GB/s | x one send |")
    print("|---|---|---|")
    for programs, gbs in kernel_rows:
        print(f"| {programs or 'one per run slice'} | {gbs:.1f} | {gbs / one[1 << 30]:.2f}x |")


if __name__ == "__main__":
    main()
