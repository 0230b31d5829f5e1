"""DSpark block attention vs a decode step on the same context, both in CUDA graphs: tile sweep."""
import sys, time
sys.path.insert(0, "scripts")
import kernel_bench  # noqa: F401
from functools import partial
import torch
import triton.testing as tt
from kernel_bench import paged_inputs as T
from pdflow.kernels.block_attention import block_attention
from pdflow.kernels.decode_attention import decode_attention
DT = torch.bfloat16
g = lambda fn: float(tt.do_bench_cudagraph(fn, rep=40, return_mode="median"))
hq, hkv, b, kb, ctx = 32, 8, 64, 8, 8192
t0 = time.time()
for d, budget in ((128, 75), (64, 75)):
    for page, ppb in ((16, 8), (128, 1)):
        kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, "cuda")
        q1 = torch.randn(b, hq, d, dtype=DT, device="cuda")
        q = T.randn(b, kb, hq, d, dtype=DT, device="cuda")
        kx = T.randn(b, kb, hkv, d, dtype=DT, device="cuda", seed=2)
        dec = min(g(partial(decode_attention, q1, kc, vc, cl, bt, d**-0.5)) for _ in range(2))
        ref = block_attention(q, kx, kx, kc, vc, cl, bt, d**-0.5)
        base = g(partial(block_attention, q, kx, kx, kc, vc, cl, bt, d**-0.5))
        print(f"d{d} page{page}: decode {dec*1e3:.1f} us, block default {base*1e3:.1f} us = {base/dec:.3f}x decode", flush=True)
        if page == 128:
            continue
        res, t1 = [], time.time()
        for bn in (64, 128):
            for w in (4, 8):
                for st in (2, 3, 4):
                    for s in (1, 2, 4):
                        if time.time() - t1 > budget:
                            break
                        kw = dict(block_n=bn, num_warps=w, num_stages=st, num_splits=s)
                        try:
                            err = T.rel_err(block_attention(q, kx, kx, kc, vc, cl, bt, d**-0.5, **kw), ref)
                            if not err < 1e-2:
                                print(f"  {kw} WRONG {err:.1e}"); continue
                            ms = g(partial(block_attention, q, kx, kx, kc, vc, cl, bt, d**-0.5, **kw))
                        except Exception as exc:
                            print(f"  {kw}: {type(exc).__name__} {str(exc)[:60]}"); continue
                        res.append((ms, kw))
        res.sort(key=lambda r: r[0])
        for ms, kw in res[:5]:
            print(f"  {kw}: {ms*1e3:.1f} us = {ms/dec:.3f}x decode", flush=True)
        del kc, vc
