"""Gluon prefill at 32K: work-order sections of heads (L2) and stages; checks, then
graph-timed rounds against SDPA causal (the bench's baseline: V = K)."""
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing
from kernel_bench import paged_inputs as T
from pdflow.kernels import prefill_gluon as PG
from pdflow.kernels import reference as ref

DT = torch.bfloat16
t0 = time.time()


def gms(fn):
    return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))


# 1. correctness: a mixed batch on a NaN cache, every section size, both pages
fails = 0
for d in (128, 64):
    for page, ppb in ((16, 8), (128, 1)):
        lens, qlens = [3000, 700, 1500, 129], [3000, 44, 1500, 1]
        kc, vc, cl, bt = T.make_paged(lens, 8, d, page, ppb, DT, "cuda", seed=3)
        cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = T.randn(sum(qlens), 32, d, dtype=DT, device="cuda", seed=4)
        want = ref.prefill_attention(*T.as64(q, kc, vc), cu, cl, bt, d**-0.5)
        for hg in (4, 8, 16, 32):
            for knobs in ({}, dict(persistent=True)):
                got = PG.prefill_attention_gluon(q, kc, vc, cu, cl, bt, d**-0.5, head_group=hg,
                                                 out=torch.full_like(q, float("nan")), **knobs)
                e = T.rel_err(got, want)
                ok = torch.isfinite(got).all().item() and e < 1e-2
                fails += not ok
                if not ok or hg == 4:
                    print(f"{'ok  ' if ok else 'FAIL'} d{d} page{page} hg{hg} {knobs}: {e:.2e}")
print(f"checks done, fails={fails}, {time.time() - t0:.0f}s", flush=True)


def case(t, d, page, ppb):
    kc, vc, cl, bt = T.random_paged(1, t, 8, d, page, ppb, DT, "cuda")
    q = T.randn(t, 32, d, dtype=DT, device="cuda")
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    return q, kc, vc, cu, cl, bt


def rounds(label, t, d, variants, n=3, pages=((16, 8), (128, 1))):
    q4 = T.randn(1, 32, t, d, dtype=DT, device="cuda")
    k = torch.randn(1, 8, t, d, device="cuda", dtype=DT)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
    for page, ppb in pages:
        args = case(t, d, page, ppb)
        fns = {name: (lambda kw=kw: PG.prefill_attention_gluon(*args, d**-0.5, max_seqlen_q=t, **kw))
               for name, kw in variants.items()}
        outs = {name: fn() for name, fn in fns.items()}
        first = next(iter(outs.values()))
        same = {name: bool(torch.equal(o, first)) for name, o in outs.items()}
        ratios = {name: [] for name in fns}
        for r in range(n):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                b = gms(sdpa)
                m = gms(fns[name])
                ratios[name].append(b / m)
            print(f"  {label} page{page} round {r}: " + " ".join(
                f"{nm}={ratios[nm][-1]:.3f}" for nm in fns), flush=True)
        for name in fns:
            rs = sorted(ratios[name])
            print(f"{label} T{t} d{d} page{page} {name:10s} median {rs[len(rs) // 2]:.3f} "
                  f"range {rs[0]:.3f}-{rs[-1]:.3f} same_as_first={same[name]}", flush=True)
    print(f"[{time.time() - t0:.0f}s]", flush=True)


which = sys.argv[1:] or ["d128_32k", "d64_32k", "d128_8k"]
if "d128_32k" in which:
    rounds("d128", 32768, 128, {"hg32": dict(head_group=32), "hg16": dict(head_group=16),
                                "hg8": dict(head_group=8), "hg4": dict(head_group=4),
                                "hg8st3": dict(head_group=8, stages=3),
                                "hg32st3": dict(head_group=32, stages=3)})
if "d64_32k" in which:
    rounds("d64", 32768, 64, {"hg32": dict(head_group=32), "hg16": dict(head_group=16),
                              "hg8": dict(head_group=8)})
if "d128_8k" in which:
    rounds("d128", 8192, 128, {"hg32": dict(head_group=32), "hg8": dict(head_group=8)},
           pages=((16, 8),))
