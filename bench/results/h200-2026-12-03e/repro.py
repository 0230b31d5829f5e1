"""The illegal address seen after the d64 decode sweep at 8K: same order, launch-blocking, each step printed."""
import os, sys
os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
sys.path.insert(0, "scripts")
import kernel_bench  # noqa: F401
from functools import partial
import torch
import triton.testing as tt
from kernel_bench import paged_inputs as T
from pdflow.kernels.decode_attention import decode_attention
DT = torch.bfloat16
g = lambda fn: float(tt.do_bench_cudagraph(fn, rep=20, return_mode="median"))
hq, hkv, b, d, ctx = 32, 8, 64, 64, 8192
tiles = [dict(block_n=64, num_warps=4, num_stages=4)]
tiles += [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (64, 128, 256) for w in (2, 4, 8) for st in (2, 3, 4)]
tiles += [dict(block_n=bn, num_warps=w, num_stages=st, num_splits=2) for bn in (64, 128) for w in (2, 4) for st in (3, 4)]
for page, ppb in ((16, 8), (128, 1)):
    q = torch.randn(b, hq, d, dtype=DT, device="cuda")
    kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, "cuda")
    print(f"page{page}: kc {tuple(kc.shape)} bt {tuple(bt.shape)} max {int(bt.max())}", flush=True)
    ref = decode_attention(q, kc, vc, cl, bt, d**-0.5, block_n=64, num_warps=4, num_stages=4)
    torch.cuda.synchronize()
    for kw in (tiles if page == 16 else tiles[:1] + [dict(block_n=128, num_warps=4, num_stages=4)]):
        print(f"  {kw}", end=" ", flush=True)
        try:
            out = decode_attention(q, kc, vc, cl, bt, d**-0.5, **kw); torch.cuda.synchronize()
            err = T.rel_err(out, ref)
            ms = g(partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, **kw)); torch.cuda.synchronize()
            print(f"err {err:.1e} {ms*1e3:.1f} us", flush=True)
        except Exception as exc:
            print(f"{type(exc).__name__}: {str(exc)[:200]}", flush=True)
            raise
    del kc, vc
print("repro: no fault", flush=True)
