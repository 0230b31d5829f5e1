"""Device exploration (graph-timed): d64 decode tiles, d64 Gluon prefill knobs, fp8 page-16 decode."""
import itertools, sys, time
sys.path.insert(0, "scripts")
import kernel_bench  # noqa: F401  (maps kernels/ to pdflow.kernels)
from functools import partial
import torch, torch.nn.functional as F
import triton.testing as tt
from kernel_bench import paged_inputs as T
from kernel_bench.fp8 import fp8_paged, fp8_decode_bytes
from kernel_bench.shapes import decode_bytes, causal_flops
from pdflow.kernels.decode_attention import decode_attention
from pdflow.kernels import prefill_gluon as PG

DT = torch.bfloat16
def g(fn):
    return float(tt.do_bench_cudagraph(fn, rep=40, return_mode="median"))
copies = {}
def copy_ms(nbytes):
    if nbytes not in copies:
        src = torch.randn(nbytes // 4, device="cuda").to(DT); dst = torch.empty_like(src)
        copies[nbytes] = min(g(lambda: torch.mul(src, 1, out=dst)) for _ in range(2))
    return copies[nbytes]

def decode_sweep(label, d, ctxs, pages, tiles, fp8=False, budget=150):
    t0 = time.time(); hq, hkv, b = 32, 8, 64
    for ctx in ctxs:
        for page, ppb in pages:
            q = torch.randn(b, hq, d, dtype=DT, device="cuda")
            if fp8:
                kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, "cuda")
                call = lambda **kw: decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw)
                nb = fp8_decode_bytes(b, ctx, hq, hkv, d)
            else:
                kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, "cuda")
                call = lambda **kw: decode_attention(q, kc, vc, cl, bt, d**-0.5, **kw)
                nb = decode_bytes(b, ctx, hq, hkv, d)
            ref = call(); base = copy_ms(nb); res = []
            dflt = g(call)
            print(f"{label} d{d} ctx{ctx} page{page}: default {dflt*1e3:.1f} us -> {base/dflt:.3f} of copy ({base*1e3:.1f} us)", flush=True)
            for kw in tiles:
                if time.time() - t0 > budget:
                    print("  budget spent"); break
                try:
                    out = call(**kw)
                    err = T.rel_err(out, ref)
                    if not err < 1e-2:
                        print(f"  {kw}: WRONG {err:.1e}"); continue
                    ms = g(partial(call, **kw))
                except Exception as exc:
                    print(f"  {kw}: {type(exc).__name__} {str(exc)[:80]}"); continue
                res.append((ms, kw))
            res.sort(key=lambda r: r[0])
            for ms, kw in res[:6]:
                print(f"  {kw}: {ms*1e3:.1f} us -> {base/ms:.3f} of copy", flush=True)
            del kc, vc

def prefill_explore(d=64, budget=150, lengths=(2048, 8192, 32768)):
    t0 = time.time(); hq, hkv = 32, 8
    for t in lengths:
        q4 = torch.randn(1, hq, t, d, dtype=DT, device="cuda")
        k = torch.randn(1, hkv, t, d, device="cuda", dtype=DT)
        sd = min(g(partial(F.scaled_dot_product_attention, q4, k, k, is_causal=True, enable_gqa=True)) for _ in range(2))
        fl = causal_flops(t, hq, d)
        print(f"prefill d{d} T{t}: sdpa {sd*1e3:.1f} us ({fl/sd/1e9:.0f} TFLOP/s)", flush=True)
        for page, ppb in ((16, 8), (128, 1)):
            kc, vc, cl, bt = T.random_paged(1, t, hkv, d, page, ppb, DT, "cuda")
            qq = torch.randn(t, hq, d, dtype=DT, device="cuda")
            cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
            ref = PG.prefill_attention_gluon(qq, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t)
            for st, pp, pers, nc in [(2, False, False, 2), (2, True, False, 2), (3, False, False, 2),
                                     (2, False, False, 3), (3, False, False, 3), (4, False, False, 3),
                                     (2, False, True, 3), (2, False, False, 2)]:
                if time.time() - t0 > budget:
                    break
                fn = partial(PG.prefill_attention_gluon, qq, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t,
                             stages=st, pingpong=pp, persistent=pers, consumers=nc)
                try:
                    err = T.rel_err(fn(), ref)
                    ms = g(fn)
                except Exception as exc:
                    print(f"  nc{nc} st{st} pp{pp} pers{pers}: {type(exc).__name__} {str(exc)[:80]}"); continue
                print(f"  page{page} nc{nc} st{st} pp{int(pp)} pers{int(pers)}: {ms*1e3:.1f} us {sd/ms:.3f}x sdpa err {err:.1e}", flush=True)

which = sys.argv[1:]
if "decode64" in which:
    tiles = [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (64, 128, 256) for w in (2, 4, 8) for st in (2, 3, 4)]
    tiles += [dict(block_n=bn, num_warps=w, num_stages=st, num_splits=2) for bn in (64, 128) for w in (2, 4) for st in (3, 4)]
    decode_sweep("bf16", 64, (2048, 8192), ((16, 8), (128, 1)), tiles, budget=200)
    decode_sweep("bf16", 64, (32768,), ((16, 8),), [t for t in tiles if t["block_n"] == 128], budget=60)
if "prefill64" in which:
    prefill_explore(64, budget=130)
if "prefill128" in which:
    prefill_explore(128, budget=60, lengths=(8192,))
if "fp8" in which:
    tiles = [dict(block_n=bn, num_warps=w, num_stages=st, v_pages=vp) for bn in (128, 256) for w in (2, 4) for st in (2, 3, 4) for vp in (True, False)]
    decode_sweep("fp8", 128, (2048, 8192), ((16, 8),), tiles, fp8=True, budget=120)
