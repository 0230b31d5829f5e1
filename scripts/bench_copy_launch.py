"""Host time of one pack launch on a ``transfer=nccl`` request's path, in one run on one
GPU: ``copy_plan`` as the pairs call it, Triton's JIT entry alone (the kernel launched
directly), and the compiled kernel's own runner (what a launch cache in front of the JIT
entry would pay), plus the request's block-id copy for scale. Each is a host step before
the request's first chunk can move (``bench_p2p_host.py`` has the rest, on two GPUs).
Measured on an H200 host: the runner saves nothing over the JIT entry (``bench/RESULTS.md``),
so no launch cache was kept.

    python scripts/bench_copy_launch.py      # needs a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from pdflow.kernels import copy_runs


def _host_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128, help="blocks in the request (128 x 128 tokens: 16K)")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    runs, words = 64, 2048  # per block: 64 runs of 16 KiB (a page-128 head cut's shape)
    cache = torch.randint(0, 255, (args.blocks * runs * words * 8,), dtype=torch.uint8, device=dev)
    out = torch.empty_like(cache)
    keep = [torch.arange(runs, dtype=torch.int64, device=dev) * words * 8 + cache.data_ptr(),
            torch.tensor([runs * words * 8], dtype=torch.int64, device=dev),
            torch.full((runs,), words, dtype=torch.int64, device=dev),
            torch.arange(runs, dtype=torch.int64, device=dev) * words * 8]
    plan = torch.tensor([[1, runs, runs * words * 8, *(t.data_ptr() for t in keep)]], dtype=torch.int64, device=dev)
    ids = torch.randperm(args.blocks, device=dev)
    rows = args.blocks * runs
    block, parts = copy_runs._slices(words)

    def jit_entry():
        return copy_runs._copy_plan_kernel[(rows, parts)](plan, ids.data_ptr(), args.blocks, 0, out.data_ptr(),
                                                          GROUPS=1, BLOCK=block, REVERSE=False)

    def now():
        copy_runs.copy_plan(plan, ids, args.blocks, 0, rows, words, shift=out.data_ptr())

    runner = jit_entry()[(rows, parts, 1)]  # the compiled kernel, launched without the JIT entry

    host = torch.zeros(args.blocks, dtype=torch.int64, pin_memory=True)
    on_dev = torch.zeros(args.blocks, dtype=torch.int64, device=dev)
    figures = [("copy_plan, as the pairs call it", _host_us(now, args.reps)),
               ("the kernel through Triton's JIT entry", _host_us(jit_entry, args.reps)),
               ("the compiled kernel's runner", _host_us(
                   lambda: runner(plan, ids.data_ptr(), args.blocks, 0, out.data_ptr(), 1, block, False), args.reps)),
               ("the block ids, pinned host to device", _host_us(lambda: on_dev.copy_(host, non_blocking=True),
                                                                 args.reps))]
    want = out.clone()
    out.zero_()
    runner(plan, ids.data_ptr(), args.blocks, 0, out.data_ptr(), 1, block, False)
    torch.cuda.synchronize()
    same = torch.equal(out, want)
    print(f"# host time of one pack launch (median of {args.reps}, us); {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}; {args.blocks} blocks x {runs} runs; the runner leaves copy_plan's bytes: "
          f"{'yes' if same else 'NO'}\n")
    print("| step | us |\n|---|---|")
    for name, us in figures:
        print(f"| {name} | {us:.1f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
