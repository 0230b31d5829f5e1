"""Device probe: the old small-row kernel (HEAD) vs the new one vs cuBLAS, in graphs."""
import sys
sys.path.insert(0, "scripts/kernel_bench"); sys.path.insert(0, "scratch")
import torch, torch.nn.functional as F
from small_m_micro import graph_us
import small_m_old as old
from pdflow.kernels.small_m_linear import small_m_linear, small_m_linear_reference
for rows, n, k in [(8, 1024, 256), (8, 256, 512), (8, 256, 768), (8, 1536, 256), (8, 512, 256), (8, 128, 256), (8, 256, 1024), (3, 256, 768), (16, 256, 768)]:
    x, w = torch.randn(rows, k, device="cuda"), torch.randn(n, k, device="cuda")
    ref = small_m_linear_reference(x, w)
    e_new = (small_m_linear(x, w) - ref).abs().max().item(); e_old = (old.small_m_linear(x, w) - ref).abs().max().item(); e_t = (F.linear(x, w) - ref).abs().max().item()
    print(f"rows {rows} n {n} k {k}: cublas {graph_us(lambda: F.linear(x, w)):.1f} old {graph_us(lambda: old.small_m_linear(x, w)):.1f} new {graph_us(lambda: small_m_linear(x, w)):.1f} us; err torch {e_t:.1e} old {e_old:.1e} new {e_new:.1e}", flush=True)
