"""Device probe: decode at 2K/8K (bf16 and fp8), in CUDA graphs, vs SM copies of the same bytes in graphs."""
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, "scripts/kernel_bench")
from functools import partial
import torch, triton, triton.language as tl
import triton.testing as tt
from kernel_bench.fp8 import fp8_paged, fp8_decode_bytes
from kernel_bench import paged_inputs as T
from kernel_bench.shapes import PAGES, DT, decode_bytes
from pdflow.kernels.decode_attention import decode_attention

@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + o, tl.load(src + o, mask=o < n), mask=o < n)

hq, hkv, d, b = 32, 8, 128, 64
g = lambda fn: float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))
for ctx in (2048, 8192):
    for page, ppb in PAGES:
        for kind in ("bf16", "fp8"):
            q = torch.randn(b, hq, d, dtype=DT, device="cuda")
            if kind == "fp8":
                kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, "cuda")
                fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs); nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
            else:
                kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, "cuda")
                fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5); nbytes = decode_bytes(b, ctx, hq, hkv, d)
            src = torch.randn(nbytes // 4, device="cuda").to(DT); dst = torch.empty_like(src); n = src.numel()
            tri = lambda: _copy[(triton.cdiv(n, 8192),)](src, dst, n, BLOCK=8192, num_warps=8)
            mul = lambda: torch.mul(src, 1, out=dst)
            for rep in range(2):
                c1, c2, dec = g(tri), g(mul), g(fn)
                print(f"{kind} ctx{ctx} page{page} rep{rep}: graph triton copy {c1:.4f} torch mul {c2:.4f} decode {dec:.4f} -> {min(c1, c2)/dec:.3f} of the faster copy", flush=True)
            del kc, vc
