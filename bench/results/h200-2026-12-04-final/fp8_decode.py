"""fp8 decode (the default launch) vs an SM copy of the same bytes, in CUDA graphs, at the
bench's shape (B64, 32 q / 8 KV heads, d128): a check against the float64 reference per
page size, then three rounds alternating which of the pair is timed first; medians."""
import statistics
import sys
from functools import partial

import torch
import triton.testing as tt

sys.path.insert(0, "scripts")
from kernel_bench.fp8 import fp8_decode_bytes, fp8_paged  # noqa: E402
from kernel_bench.shapes import PAGES  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402


def g(fn):
    torch.cuda.synchronize()  # the graph's stream does not wait for the one the inputs were made on
    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))


dev, b, hq, hkv, d = "cuda", 64, 32, 8, 128
for page, ppb in PAGES:
    lens = [8192, 1, 4099, 777, 3000]
    kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, ppb, dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
    want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
    got = decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs).double()
    err = float((got - want).norm() / want.norm())
    print(f"check page{page}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
for ctx in (2048, 8192, 32768):
    for page, ppb in PAGES:
        kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, dev)
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
        src = torch.randn(nbytes // 4, device=dev).to(torch.bfloat16)
        dst = torch.empty_like(src)
        dec = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs)
        cp = partial(torch.mul, src, 1, out=dst)
        ratios = []
        for r in range(3):
            if r % 2 == 0:
                t_dec, t_cp = g(dec), g(cp)
            else:
                t_cp, t_dec = g(cp), g(dec)
            ratios.append(t_cp / t_dec)
        print(f"fp8 decode ctx{ctx} page{page}: vs same-traffic copy {statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}; decode {t_dec * 1e3:.1f} us)", flush=True)
