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

import torch
import torch.distributed as dist
from bench_nccl_chunks import (  # scripts/ sits beside this file
    RUN,
    SLOT,
    _timed,
    ack,
    out_of_order_runs,
    pipeline,
    two_ranks,
)

MiB = 1 << 20


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

    table = out_of_order_runs(caches, SLOT)

    def pack(i, half):
        copy_runs(table[: half.numel() // RUN], RUN // 8, shift=half.data_ptr())

    def scatter(i, half):
        copy_runs(table[: half.numel() // RUN], RUN // 8, shift=half.data_ptr(), reverse=True)

    def one(b, total):
        (pg.send if rank == 0 else pg.recv)([b["wire"][:total]], 1 - rank, 0).wait()
        ack(pg, rank, b["ack"])

    def piped(b, total, chunk=SLOT):
        halves = [b["slots"][:chunk], b["slots"][SLOT:SLOT + chunk]]
        pipeline(pg, rank, halves, total // chunk, pack, scatter, b["ack"])

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
    rows = two_ranks(_rank, 240)
    print(f"# {torch.cuda.get_device_name(0)} torch {torch.__version__} nccl {torch.cuda.nccl.version()} "
          f"env hook={os.environ.get('TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK', '0')} {' '.join(sys.argv[1:])}")
    print("| buffers | MiB | one send GB/s | two-slot pipeline + copy_runs GB/s | pipeline / plain one send |")
    plain = {t: one for name, t, one, _ in rows if name == "plain"}
    for name, total, one, pipe in rows:
        print(f"| {name} | {total // MiB} | {one:.1f} | {pipe:.1f} | {pipe / plain[total]:.2f}x |")


if __name__ == "__main__":
    main()
