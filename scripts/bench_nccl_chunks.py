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


def _rank(rank: int, path: str, result) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = dist.ProcessGroupNCCL(dist.FileStore(path, 2), rank, 2, dist.ProcessGroupNCCL.Options())
    wire = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    caches = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # what the pack reads, the scatter writes
    slots = torch.empty(2 * SLOT, dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.int64, device=dev)

    def acked() -> None:
        if rank == 0:
            group.recv([ack], 1, 0).wait()
        else:
            group.send([ack], 0, 0).wait()

    def plain(total: int, chunk: int) -> None:
        for i in range(total // chunk):
            part = wire[i * chunk:(i + 1) * chunk]
            group.send([part], 1, 0) if rank == 0 else group.recv([part], 0, 0)
        acked()

    tables: dict[int, torch.Tensor] = {}

    def runs_of(chunk: int) -> torch.Tensor:
        """(cache address, offset in the chunk, words) of a chunk's runs, taken out of order."""
        n = chunk // RUN
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        return torch.stack([caches.data_ptr() + order * RUN, torch.arange(n) * RUN,
                            torch.full((n,), RUN // 8)], dim=1).contiguous().to(dev)

    def copier(programs):
        """(pack, scatter) of chunk i: contiguous copies (None) or copy_runs over its runs."""
        if programs is None:
            return (lambda i, c, h: h.copy_(caches[i * c:(i + 1) * c]),
                    lambda i, c, h: caches[i * c:(i + 1) * c].copy_(h))
        from pdflow.kernels.copy_runs import copy_runs

        def table(c):  # built once per chunk size (in the warm-up), not per timed call
            if c not in tables:
                tables[c] = runs_of(c)
            return tables[c]

        return (lambda i, c, h: copy_runs(table(c), RUN // 8, shift=h.data_ptr(), programs=programs),
                lambda i, c, h: copy_runs(table(c), RUN // 8, shift=h.data_ptr(), reverse=True, programs=programs))

    def piped(total: int, chunk: int, programs=None) -> None:
        pack, scatter = copier(programs)
        halves = [slots[:chunk], slots[SLOT:SLOT + chunk]]
        n = total // chunk
        if rank == 0:  # pack chunk i+1 while chunk i is on the wire
            works = [None, None]
            for i in range(n):
                if works[i % 2] is not None:
                    works[i % 2].wait()
                pack(i, chunk, halves[i % 2])
                works[i % 2] = group.send([halves[i % 2]], 1, 0)
        else:  # receive chunk i+1 while chunk i is scattered
            pending = {0: group.recv([halves[0]], 0, 0)}
            for i in range(n):
                if i + 1 < n:
                    pending[i + 1] = group.recv([halves[(i + 1) % 2]], 0, 0)
                pending.pop(i).wait()
                scatter(i, chunk, halves[i % 2])
        acked()

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
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), result)) for r in (0, 1)]
        for p in procs:
            p.start()
        rows, kernel_rows = result.get(timeout=300)
        for p in procs:
            p.join(30)
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
