#!/usr/bin/env python
"""What chunking costs ``transfer=nccl`` before any cut: a request of 128 MiB and 1 GiB
sent between two GPUs as back-to-back NCCL sends of 16-256 MiB chunks, and through the
pair's two-slot pipeline with a contiguous device copy standing in for the pack and the
scatter, each against one send of the whole (plus an 8-byte ack, as the pair acks) in the
same run. The ceiling ``bench_gpu_transfer.py``'s packed pairs can reach.

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

    def piped(total: int, chunk: int) -> None:
        halves = [slots[:chunk], slots[SLOT:SLOT + chunk]]
        n = total // chunk
        if rank == 0:  # pack chunk i+1 while chunk i is on the wire
            works = [None, None]
            for i in range(n):
                if works[i % 2] is not None:
                    works[i % 2].wait()
                halves[i % 2].copy_(caches[i * chunk:(i + 1) * chunk])
                works[i % 2] = group.send([halves[i % 2]], 1, 0)
        else:  # receive chunk i+1 while chunk i is scattered
            pending = {0: group.recv([halves[0]], 0, 0)}
            for i in range(n):
                if i + 1 < n:
                    pending[i + 1] = group.recv([halves[(i + 1) % 2]], 0, 0)
                pending.pop(i).wait()
                caches[i * chunk:(i + 1) * chunk].copy_(halves[i % 2])
        acked()

    rows = []
    for total in TOTALS:
        for chunk in (total, *(c for c in CHUNKS if c < total)):
            t_plain = _timed(lambda t=total, c=chunk: plain(t, c))
            t_piped = _timed(lambda t=total, c=chunk: piped(t, c)) if chunk <= SLOT else float("nan")
            rows.append((total, chunk, total / t_plain / 1e9, total / t_piped / 1e9))
    if rank == 0:
        result.put(rows)


def main() -> None:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), result)) for r in (0, 1)]
        for p in procs:
            p.start()
        rows = result.get(timeout=300)
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


if __name__ == "__main__":
    main()
