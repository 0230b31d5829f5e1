"""fp8 decode page-16 variants (scratch_fp8/dav.py) vs the committed kernel, all in CUDA graphs,
vs a same-traffic SM copy; each round times the variants in a rotated order (the harness's
second-timed bias), medians over rounds."""
import os, sys, time, statistics
sys.path.insert(0, "scripts"); sys.path.insert(0, "scratch_fp8")
import kernel_bench  # noqa
from functools import partial
import torch
import triton.testing as tt
from kernel_bench import paged_inputs as T
from kernel_bench.fp8 import fp8_paged, fp8_decode_bytes
from pdflow.kernels import reference as ref
from pdflow.kernels import decode_attention as CUR
import dav as V
DT = torch.bfloat16
REP = int(os.environ.get("REP", "30")); ROUNDS = int(os.environ.get("ROUNDS", "3"))
g = lambda fn: float(tt.do_bench_cudagraph(fn, rep=REP, return_mode="median"))
hq, hkv, d, b = 32, 8, 128, 64
import da_old as OLD
VARIANTS = {  # name -> (module, kwargs)
    "old": (OLD, {}),
    "new": (CUR, {}),
    "t1": (V, dict(tail=1)),
    "kp0": (V, dict(k_pages=True)),
    "new_st3": (CUR, dict(num_stages=3)),
    "new_w4": (CUR, dict(num_warps=4)),
    "new_s2": (CUR, dict(num_splits=2)),
    "old_again": (OLD, {}),
}
sel = os.environ.get("VARS")
if sel:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in sel.split(",")}
t0 = time.time()
# correctness: ragged lengths, splits default and 4, pages 16 and 128
TINY = bool(os.environ.get("TINY"))
DEV = "cpu" if TINY else "cuda"
lens = [300, 1, 33, 17, 129] if TINY else [8192, 1, 4099, 777, 3000, 128, 129, 16]
bad = []
for page, ppb in ((16, 8), (128, 1), (32, 2)):
    kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, ppb, DEV, seed=page)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = T.randn(len(lens), hq, d, dtype=DT, device=DEV, seed=page)
    want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
    for name, (m, kw) in VARIANTS.items():
        if page != 16 and name not in ("old", "new"):
            continue
        for splits in ((None, 4) if name == "new" else (None,)):
            kw2 = {**kw, "num_splits": kw.get("num_splits", splits)}
            out = torch.full_like(q, float("nan"))
            got = m.decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, out=out, **kw2)
            err = T.rel_err(got, want)
            ok = err < 1e-2 and bool(torch.isfinite(got).all())
            if not ok: bad.append((name, page, splits, err))
            print(f"  check page{page} {name} splits{kw2['num_splits']}: {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
if TINY: sys.exit(0)
print(f"checks done {time.time()-t0:.0f}s; failures: {bad}", flush=True)
copies = {}
def copy_ms(nbytes):
    if nbytes not in copies:
        src = torch.randn(nbytes // 4, device="cuda").to(DT); dst = torch.empty_like(src)
        copies[nbytes] = statistics.median(g(lambda: torch.mul(src, 1, out=dst)) for _ in range(3))
        del src, dst
    return copies[nbytes]
summary = []
pages = [(16, 8)] + ([(128, 1)] if os.environ.get("P128") else [])
for ctx in (2048, 8192, 32768):
    for page, ppb in pages:
        kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, "cuda")
        q = T.randn(b, hq, d, dtype=DT, device="cuda")
        names = [n for n in VARIANTS if not (page == 128 and n not in ("old", "new", "old_again"))]
        fns = {n: partial(VARIANTS[n][0].decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, **VARIANTS[n][1]) for n in names}
        for fn in fns.values(): fn()
        ts = {n: [] for n in names}
        for r in range(ROUNDS):
            order = names[r % len(names):] + names[:r % len(names)]
            if r % 2: order = order[::-1]
            for n in order:
                ts[n].append(g(fns[n]))
        c = copy_ms(fp8_decode_bytes(b, ctx, hq, hkv, d))
        line = f"page{page} ctx{ctx} copy {c*1e3:.1f}us: " + "  ".join(
            f"{n} {statistics.median(v)*1e3:.1f}us {c/statistics.median(v):.3f}x [{c/max(v):.3f}-{c/min(v):.3f}]" for n, v in ts.items())
        print(line, flush=True); summary.append(line)
        del kc, vc, ks, vs
        torch.cuda.empty_cache()
print(f"\n== summary ({time.time()-t0:.0f}s)\n" + "\n".join(summary))
