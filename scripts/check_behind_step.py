"""Checks ``bench_gpu_transfer.py``'s "behind a step" clock on one GPU, before its figures
are read on two: a transfer stand-in (a device copy of ``--mib``) with a host head of
``--head-ms`` (host busy before the copy is issued) is timed behind steps of several
lengths. A step longer than the head must give the copy's own event-timed duration (the
head hidden, as the engine hides an export's host steps behind the forward); a shorter
step must show the head's excess. Prints the table; exits 1 when either does not hold.

    python scripts/check_behind_step.py      # needs a GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu_transfer import _behind_step, _sleep_cycles  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--head-ms", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    src = torch.randint(0, 255, (args.mib << 20,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def transfer():
        until = time.perf_counter() + args.head_ms / 1e3
        while time.perf_counter() < until:  # the host's steps before the bytes move
            pass
        dst.copy_(src)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copies = []
    for _ in range(args.reps + 2):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        copies.append(start.elapsed_time(end))
    copy_ms = sorted(copies[2:])[len(copies[2:]) // 2]
    print(f"{torch.cuda.get_device_name(0)}; {args.mib} MiB device copy (events): {copy_ms:.3f} ms; "
          f"host head {args.head_ms} ms\n")
    print("| step ms | behind the step ms | minus the copy ms | expected |\n|---|---|---|---|")
    ok = True
    for step in (0.05, args.head_ms / 2, 2 * args.head_ms, 4 * args.head_ms):
        secs = _behind_step(transfer, args.reps, device, _sleep_cycles(step, device))
        extra = secs * 1e3 - copy_ms
        hidden = step > args.head_ms * 1.2
        want = "< 0.05 (head hidden)" if hidden else f"~{args.head_ms - step:.2f} (head shows)"
        ok &= extra < 0.05 if hidden else extra > 0.5 * (args.head_ms - step)
        print(f"| {step:.2f} | {secs * 1e3:.3f} | {extra:.3f} | {want} |")
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
