"""The small-row fp32 linear against cuBLAS, each timed inside a CUDA graph of
20 calls (as the drafted step replays them), on the shapes of a drafted fp32 step; with
``--sweep``, also its columns per program and warps (the default's rank among them).

  python scripts/kernel_bench/small_m_micro.py [--sweep]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from pdflow.kernels.small_m_linear import small_m_linear, small_m_linear_reference


def graph_us(fn, calls: int = 20) -> float:
    """Device microseconds per call: ``calls`` calls captured in one graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (20 * calls)


def sweep(x, w, default_us: float) -> str:
    """The fastest columns-per-program x warps of this shape, and where the default stands."""
    timed = sorted((graph_us(lambda b=b, nw=nw: small_m_linear(x, w, block_n=b, num_warps=nw)), b, nw)
                   for b in (1, 2, 4, 8, 16) for nw in (1, 2, 4, 8)
                   if b * w.shape[1] <= 128 * 32 * nw)  # at most 128 weights a thread
    best = ", ".join(f"bn{b} w{nw} {us:.1f}" for us, b, nw in timed[:3])
    return f"sweep best: {best} (default / best {default_us / timed[0][0]:.2f})"


def shape_row(rows: int, n: int, k: int, with_sweep: bool = False) -> str:
    x, w = torch.randn(rows, k, device="cuda"), torch.randn(n, k, device="cuda")
    ref = small_m_linear_reference(x, w)
    cublas, mine = graph_us(lambda: F.linear(x, w)), graph_us(lambda: small_m_linear(x, w))
    err = (small_m_linear(x, w) - ref).abs().max().item()
    row = [f"rows {rows} n {n} k {k}: cublas {cublas:.1f} us", f"small_m {mine:.1f} us (err {err:.1e})",
           f"cublas/small_m {cublas / mine:.2f}x"]
    x1 = x[:1].contiguous()
    row.append(f"1-row gemv {graph_us(lambda: F.linear(x1, w)):.1f} us")
    if with_sweep and k <= 1024:
        row.append(sweep(x, w, mine))
    return ", ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time columns per program x warps")
    args = parser.parse_args()
    for rows, n, k in [(8, 1024, 256), (8, 256, 1024), (8, 256, 768), (8, 1536, 256), (8, 768, 256),
                       (8, 256, 256), (8, 256, 512), (8, 512, 256), (8, 128, 256), (16, 1024, 256), (8, 3072, 1024),
                       (8, 1024, 3072), (8, 1024, 512), (8, 512, 512)]:
        print(shape_row(rows, n, k, args.sweep), flush=True)


if __name__ == "__main__":
    main()
