"""16-bit decode (2K, 8K) vs a same-traffic SM copy and the DSpark block pass (K=8, 8K) / a decode
step, d128 (and d64 with D64=1), pages 16 and 128, B64, all in CUDA graphs, medians of 3 rounds."""
import os, sys, statistics
sys.path.insert(0, "scripts")
import kernel_bench  # noqa
from functools import partial
import torch
import triton.testing as tt
from kernel_bench import paged_inputs as T
from kernel_bench.shapes import decode_bytes
from pdflow.kernels import reference as ref
from pdflow.kernels import decode_attention as NEW
DT = torch.bfloat16
g = lambda fn: float(tt.do_bench_cudagraph(fn, rep=30, return_mode="median"))
hq, hkv, b = 32, 8, 64
copies = {}
def copy_ms(nbytes):
    if nbytes not in copies:
        src = torch.randn(nbytes // 4, device="cuda").to(DT); dst = torch.empty_like(src)
        copies[nbytes] = statistics.median(g(lambda: torch.mul(src, 1, out=dst)) for _ in range(3))
    return copies[nbytes]
for d in ((128, 64) if os.environ.get("D64") else (128,)):
    for page, ppb in ((16, 8), (128, 1)):
        res = {}
        for ctx in (2048, 8192):
            kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, "cuda")
            q = T.randn(b, hq, d, dtype=DT, device="cuda")
            fns = {"decode": partial(NEW.decode_attention, q, kc, vc, cl, bt, d**-0.5)}
            if ctx == 2048:
                print(f"  check decode d{d} p{page}: {T.rel_err(fns['decode'](), ref.decode_attention(*T.as64(q, kc, vc), cl, bt, d**-0.5)):.2e}")
            if ctx == 8192:
                qb = T.randn(b, 8, hq, d, dtype=DT, device="cuda")
                kx = T.randn(b, 8, hkv, d, dtype=DT, device="cuda", seed=2)
                want = ref.block_attention(*T.as64(qb, kx, kx, kc, vc), cl, bt, d**-0.5)
                print(f"  check block d{d} p{page}: {T.rel_err(NEW.paged_attention(qb, kc, vc, cl, bt, d**-0.5, kx, kx), want):.2e}")
                fns["block"] = partial(NEW.paged_attention, qb, kc, vc, cl, bt, d**-0.5, kx, kx)
            ts = {k: [] for k in fns}
            for r in range(3):
                for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    ts[k].append(g(fns[k]))
            res[ctx] = {k: statistics.median(v) for k, v in ts.items()}
            c = copy_ms(decode_bytes(b, ctx, hq, hkv, d))
            print(f"bf16 decode d{d} page{page} ctx{ctx}: {res[ctx]['decode']*1e3:.1f}us = {c/res[ctx]['decode']:.3f}x same-traffic copy", flush=True)
            del kc, vc
        print(f"block d{d} page{page} K8 ctx8192: {res[8192]['block']*1e3:.1f}us = {res[8192]['block']/res[8192]['decode']:.3f}x a decode step", flush=True)
