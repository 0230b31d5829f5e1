"""The small-row fp32 linear against cuBLAS, each timed inside a CUDA graph of
20 calls (as the drafted step replays them), on the shapes of a drafted fp32 step.

  python scripts/kernel_bench/small_m_micro.py
"""

from __future__ import annotations

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


def shape_row(rows: int, n: int, k: int) -> str:
    x, w = torch.randn(rows, k, device="cuda"), torch.randn(n, k, device="cuda")
    ref = small_m_linear_reference(x, w)
    cublas, mine = graph_us(lambda: F.linear(x, w)), graph_us(lambda: small_m_linear(x, w))
    err = (small_m_linear(x, w) - ref).abs().max().item()
    row = [f"rows {rows} n {n} k {k}: cublas {cublas:.1f} us", f"small_m {mine:.1f} us (err {err:.1e})",
           f"cublas/small_m {cublas / mine:.2f}x"]
    x1 = x[:1].contiguous()
    row.append(f"1-row gemv {graph_us(lambda: F.linear(x1, w)):.1f} us")
    return ", ".join(row)


def main() -> None:
    for rows, n, k in [(8, 1024, 256), (8, 256, 1024), (8, 256, 768), (8, 1536, 256), (8, 768, 256),
                       (8, 256, 256), (8, 512, 256), (8, 128, 256), (16, 1024, 256), (8, 3072, 1024),
                       (8, 1024, 3072), (8, 1024, 512), (8, 512, 512)]:
        print(shape_row(rows, n, k), flush=True)


if __name__ == "__main__":
    main()
