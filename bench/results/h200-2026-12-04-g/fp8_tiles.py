"""fp8 decode at page 16 (issue 35's last open figure: 2K context at 0.88-0.92x a copy of
its bytes): the default launch against other tiles, and the fp8 DSpark block pass (K=8,
not timed before) against an fp8 decode step, at the bench's shape (B64, 32 q / 8 KV heads,
d128), in CUDA graphs, inputs made right before each timing; three rounds rotating the
order of every candidate and the copy; medians."""
import statistics
import sys
from functools import partial

import torch
import triton.testing as tt

sys.path.insert(0, "scripts")
from kernel_bench.fp8 import fp8_decode_bytes, fp8_paged  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.block_attention import block_attention  # noqa: E402
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402


def g(fn):
    torch.cuda.synchronize()  # the graph's stream does not wait for the one the inputs were made on
    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))


dev, b, hq, hkv, d = "cuda", 64, 32, 8, 128
TILES = {"default": {}, "bn256 w2 st2": dict(block_n=256, num_warps=2, num_stages=2),
         "bn256 w4 st2": dict(block_n=256, num_warps=4, num_stages=2),
         "bn64 w2 st2": dict(block_n=64, num_warps=2, num_stages=2),
         "bn64 w1 st2": dict(block_n=64, num_warps=1, num_stages=2),
         "bn64 w2 st3": dict(block_n=64, num_warps=2, num_stages=3),
         "bn128 w2 st3": dict(block_n=128, num_warps=2, num_stages=3)}
lens = [8192, 1, 4099, 777, 3000]
kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, 16, 16, dev)
cl = torch.tensor(lens, dtype=torch.int32, device=dev)
q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
for name, kw in TILES.items():
    try:
        got = decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw).double()
        err = float((got - want).norm() / want.norm())
        print(f"check {name}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
    except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
        print(f"check {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        TILES[name] = None
TILES = {k: v for k, v in TILES.items() if v is not None}
for ctx in (2048, 8192):
    kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, 16, 16, dev)
    q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
    nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
    src = torch.randn(nbytes // 4, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(src)
    fns = {name: partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw) for name, kw in TILES.items()}
    fns["copy"] = partial(torch.mul, src, 1, out=dst)
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(3):
        order = names[r:] + names[:r] if r % 2 == 0 else list(reversed(names))
        for n in order:
            times[n].append(g(fns[n]))
    cp = statistics.median(times["copy"])
    for n in names[:-1]:
        rs = [c / t for c, t in zip(times["copy"], times[n], strict=True)]
        print(f"fp8 decode ctx{ctx} page16 {n}: vs same-traffic copy {statistics.median(rs):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in rs)}; {statistics.median(times[n]) * 1e3:.1f} us, "
              f"copy {cp * 1e3:.1f} us)", flush=True)
    del fns, src, dst
# the fp8 DSpark block pass (K=8 rows a sequence) against the fp8 decode step, page 16 and 128
for page, ppb in ((16, 16), (128, 2)):
    kc, vc, ks, vs, cl, bt = fp8_paged(b, 8192, hkv, d, page, ppb, dev)
    qd = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
    qb = torch.randn(b, 8, hq, d, device=dev).to(torch.bfloat16)
    xk, xv = (torch.randn(b, 8, hkv, d, device=dev).to(torch.bfloat16) for _ in range(2))
    sub = slice(0, 5)
    w = ref.block_attention(qb[sub].double(), xk[sub].double(), xv[sub].double(), kc, vc, cl[sub], bt[sub],
                            d**-0.5, ks, vs)
    gb = block_attention(qb[sub], xk[sub], xv[sub], kc, vc, cl[sub], bt[sub], d**-0.5, ks, vs).double()
    err = float((gb - w).norm() / w.norm())
    dec = partial(decode_attention, qd, kc, vc, cl, bt, d**-0.5, ks, vs)
    blk = partial(block_attention, qb, xk, xv, kc, vc, cl, bt, d**-0.5, ks, vs)
    rs = []
    for r in range(3):
        if r % 2 == 0:
            td, tb = g(dec), g(blk)
        else:
            tb, td = g(blk), g(dec)
        rs.append(tb / td)
    print(f"fp8 block K8 ctx8192 page{page}: check rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}; "
          f"block / decode step {statistics.median(rs):.3f} (rounds {', '.join(f'{x:.3f}' for x in rs)}; "
          f"block {tb * 1e3:.1f} us, decode {td * 1e3:.1f} us)", flush=True)
