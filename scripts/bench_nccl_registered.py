#!/usr/bin/env python
# ruff: noqa: B023
"""Does NCCL user-buffer registration lift ``transfer=nccl``'s packed pipeline?

NCCL copies a send through its own FIFO buffers unless both ends' buffers are registered
with the communicator (then, between GPUs of one host, it maps the receive buffer over
CUDA IPC and copies straight into it). Two GPUs, one eagerly connected group: one send of
128 MiB and 1 GiB (plus an 8-byte ack) and the pair's two-slot pipeline (``copy_runs``
packs and scatters 32 KiB runs out of order, as a head cut's), with plain buffers and with
buffers from an NCCL-registered ``torch.cuda.MemPool``; every ratio against the plain one
send of the same bytes in the same run. Set ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1``
to register every allocation instead, and ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=REG`` to see
the registrations.

    python scripts/bench_nccl_registered.py          # 2 GPUs
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_nccl_chunks import _timed  # scripts/ sits beside this file

MiB = 1 << 20
SLOT = 128 * MiB
RUN = 32 * 1024


def _rank(rank, path, result):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(path, 2), rank=rank, world_size=2, device_id=dev,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(dev)
    caches = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    sets = {"plain": dict(wire=torch.empty(1 << 30, dtype=torch.uint8, device=dev),
                          slots=torch.empty(2 * SLOT, dtype=torch.uint8, device=dev),
                          ack=torch.zeros(1, dtype=torch.int64, device=dev))}
    try:
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            sets["registered"] = dict(wire=torch.empty(1 << 30, dtype=torch.uint8, device=dev),
                                      slots=torch.empty(2 * SLOT, dtype=torch.uint8, device=dev),
                                      ack=torch.zeros(1, dtype=torch.int64, device=dev))
        dist.barrier()
        backend.register_mem_pool(pool)
    except Exception as err:
        print(f"rank {rank}: registration failed: {type(err).__name__}: {err}", flush=True)
    from pdflow.kernels.copy_runs import copy_runs

    n = SLOT // RUN
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    table = torch.stack([caches.data_ptr() + order * RUN, torch.arange(n) * RUN,
                         torch.full((n,), RUN // 8)], dim=1).contiguous().to(dev)

    def acked(b):
        if rank == 0:
            dist.recv(b["ack"], 1)
        else:
            dist.send(b["ack"], 0)

    def one(b, total):
        if rank == 0:
            dist.send(b["wire"][:total], 1)
        else:
            dist.recv(b["wire"][:total], 0)
        acked(b)

    def piped(b, total, chunk=SLOT):
        slots = b["slots"]
        halves = [slots[:chunk], slots[SLOT:SLOT + chunk]]
        k = total // chunk
        if rank == 0:
            works = [None, None]
            for i in range(k):
                if works[i % 2] is not None:
                    works[i % 2].wait()
                copy_runs(table[: chunk // RUN], RUN // 8, shift=halves[i % 2].data_ptr())
                works[i % 2] = dist.isend(halves[i % 2], 1)
        else:
            pending = {0: dist.irecv(halves[0], 0)}
            for i in range(k):
                if i + 1 < k:
                    pending[i + 1] = dist.irecv(halves[(i + 1) % 2], 0)
                pending.pop(i).wait()
                copy_runs(table[: chunk // RUN], RUN // 8, shift=halves[i % 2].data_ptr(), reverse=True)
        acked(b)

    rows = []
    for name, b in sets.items():
        for total in (128 * MiB, 1 << 30):
            t1 = _timed(lambda: one(b, total))
            chunk = SLOT if total > SLOT else 32 * MiB
            t2 = _timed(lambda: piped(b, total, chunk))
            rows.append((name, total, total / t1 / 1e9, total / t2 / 1e9))
    if rank == 0:
        result.put(rows)
    dist.destroy_process_group()


def main():
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "s"), result)) for r in (0, 1)]
        for p in procs:
            p.start()
        rows = result.get(timeout=240)
        for p in procs:
            p.join(30)
    print(f"# {torch.cuda.get_device_name(0)} torch {torch.__version__} nccl {torch.cuda.nccl.version()} "
          f"env hook={os.environ.get('TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK', '0')} {' '.join(sys.argv[1:])}")
    print("| buffers | MiB | one send GB/s | two-slot pipeline + copy_runs GB/s | pipeline / plain one send |")
    plain = {t: one for name, t, one, _ in rows if name == "plain"}
    for name, total, one, pipe in rows:
        print(f"| {name} | {total // MiB} | {one:.1f} | {pipe:.1f} | {pipe / plain[total]:.2f}x |")


if __name__ == "__main__":
    main()
