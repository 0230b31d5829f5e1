#!/usr/bin/env python
"""The fused MoE kernel (kernels/fused_moe.py) against the grouped-GEMM roofline and the
torch path it replaces, one MoE layer of Qwen3-30B-A3B (128 experts, top-8, hidden 2048,
expert width 768; ``--tp`` slices the width as a TP rank holds it), bf16, one GPU.

Per token count: the kernel checked against its torch reference (max abs difference), then
timed (``triton.testing.do_bench``, median); the roofline of that call is the larger of the
bytes it must read (the experts the routed tokens hit, counted from the routing, plus
activations) at an HBM copy rate and its FLOPs (2 x pairs x 3 x hidden x width) at a GEMM
rate, both measured in this run; printed as the kernel's share of it, and its speed-up over
the torch path (experts one by one, as pdflow's CPU path and transformers run them).
Imports only torch and triton (the repo's kernels/ folder directly). Table last.

    python scripts/bench_moe.py --out /tmp/moe.md      # H200, ~1 min
    python scripts/bench_moe.py --dry-run              # CPU, interpreted, tiny shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# name: (hidden, expert width, experts, top-k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8)}
DRY = {"dry": (64, 32, 8, 2)}
TOKENS = (1, 16, 64, 256, 2048, 8192)
DRY_TOKENS = (1, 5, 40)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET, tiny shape")
    p.add_argument("--tp", type=int, default=1, help="the expert width is cut over this many ranks")
    p.add_argument("--tokens", help="comma-separated token counts (default: decode to prefill sizes)")
    p.add_argument("--out", help="also write the table (markdown) here")
    return p.parse_args(argv)


def timed(fn, dev: str) -> float:
    """Median milliseconds of ``fn``."""
    if dev == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def torch_experts(x, w13, w2, weights, ids):
    """Experts one by one over their tokens (pdflow.model.moe.experts_one_by_one)."""
    out = torch.zeros_like(x)
    n = w13.shape[1] // 2
    for expert in torch.unique(ids).tolist():
        pick, token = torch.where((ids == expert).t())
        gate, up = torch.nn.functional.linear(x[token], w13[expert]).split(n, dim=-1)
        down = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, token, down * weights[token, pick, None])
    return out


def bench(name, shape, tokens_list, tp, dev, dtype, flops_s, bytes_s) -> list[dict]:
    from kernels.fused_moe import fused_moe, fused_moe_reference, route

    hidden, width, experts, top_k = shape
    n = width // tp
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(experts, 2 * n, hidden, generator=g, device=dev) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, n, generator=g, device=dev) * n**-0.5).to(dtype)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, generator=g, device=dev).to(dtype)
        logits = torch.randn(tokens, experts, generator=g, device=dev).to(dtype)
        weights, ids = route(logits, top_k, True)
        got = fused_moe(x, w13, w2, weights, ids)
        diff = (got.float() - fused_moe_reference(x, w13, w2, weights, ids).float()).abs().max().item()
        hit = ids.unique().numel()
        elt = dtype.itemsize
        nbytes = hit * 3 * hidden * n * elt + 2 * tokens * hidden * elt
        flops = 2.0 * tokens * top_k * 3 * hidden * n
        roof_ms = max(nbytes / bytes_s, flops / flops_s) * 1e3
        call = (x, w13, w2, weights, ids)
        kernel_ms = timed(lambda c=call: fused_moe(*c), dev)
        torch_ms = timed(lambda c=call: torch_experts(*c), dev)
        rows.append(dict(shape=name, tokens=tokens, hit=hit, diff=diff, kernel_ms=kernel_ms,
                         torch_ms=torch_ms, roof_ms=roof_ms, bound="memory" if nbytes / bytes_s
                         >= flops / flops_s else "compute"))
        print(f"[{name} T={tokens}] experts hit {hit}, max |diff| {diff:.3g}, kernel {kernel_ms:.3f} ms, "
              f"torch {torch_ms:.3f} ms, roofline {roof_ms:.3g} ms", flush=True)
    return rows


def table(rows, header: str) -> str:
    lines = [header, "",
             "| shape | tokens | experts hit | max abs diff | kernel ms | torch ms | x torch | "
             "roofline ms | bound | roofline / kernel |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['hit']} | {r['diff']:.3g} | "
                     f"{r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | {r['torch_ms'] / r['kernel_ms']:.1f} | "
                     f"{r['roof_ms']:.3g} | {r['bound']} | {r['roof_ms'] / r['kernel_ms']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("no CUDA device: run with --dry-run for the interpreted CPU check", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
    sys.path.insert(0, str(ROOT))  # the repo's kernels/ folder, not an installed one
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.bfloat16
    shapes = DRY if args.dry_run else SHAPES
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (
        DRY_TOKENS if args.dry_run else TOKENS)
    flops_s, bytes_s = measure(dev, dtype)
    rows = []
    for name, shape in shapes.items():
        rows += bench(name, shape, tokens, args.tp, dev, dtype, flops_s, bytes_s)
    device = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreted)"
    out = table(rows, f"fused MoE, bf16, tp={args.tp}, {device}: GEMM {flops_s / 1e12:.0f} TFLOP/s, "
                      f"copy {bytes_s / 1e12:.2f} TB/s (measured in this run)")
    if args.out:
        Path(args.out).write_text(out + "\n")
    print(out)
    return 0


def measure(dev: str, dtype) -> tuple[float, float]:
    """(GEMM FLOP/s, copy bytes/s counting read + write), measured now."""
    n, nbytes = (8192, 1 << 30) if dev == "cuda" else (256, 16 << 20)
    a, b = (torch.randn(n, n, device=dev).to(dtype) for _ in range(2))
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    flops = 2.0 * n**3 / (timed(lambda: a @ b, dev) / 1e3)
    return flops, 2.0 * nbytes / (timed(lambda: dst.copy_(src), dev) / 1e3)


if __name__ == "__main__":
    sys.exit(main())
