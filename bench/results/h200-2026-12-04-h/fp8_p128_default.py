"""fp8 decode at page 128 with the new default (one page a tile, read as pages shorter than
the tile are: K and V as [pages, ...] with no token mask, two warps, three stages;
fp8_p128_pages.log read it 0.946 / 0.979 / 0.969x a same-traffic copy at 2K / 8K / 32K
against the old default's 0.899 / 0.898 / 0.922) against the old default (``v_pages=False``:
K per token with masks, four warps, four stages) and the stages and warps around it; page 16's
default beside. B64, 32 q / 8 KV heads, d128, CUDA graphs, three rotated rounds with the SM
copy of the same bytes; medians. Checks every tile against the reference first."""
import sys
from functools import partial

import torch

sys.path.insert(0, "scripts")
import pdflow.kernels.decode_attention as da  # noqa: E402
from kernel_bench.fp8 import fp8_decode_bytes, fp8_paged  # noqa: E402
from kernel_bench.rotated import rotated_times, same_traffic_copy, vs_copy_lines  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402


def run(kw):
    kw = dict(kw)
    page = kw.pop("page", 128)

    def call(q, kc, vc, cl, bt, ks, vs):
        return da.decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw)
    call.page = page
    return call


dev, b, hq, hkv, d = "cuda", 64, 32, 8, 128
TILES = {"default": {}, "old default (v_pages=False)": dict(v_pages=False),
         "bn128 w2 st2": dict(block_n=128, num_warps=2, num_stages=2),
         "bn128 w2 st4": dict(block_n=128, num_warps=2, num_stages=4),
         "bn128 w1 st3": dict(block_n=128, num_warps=1, num_stages=3),
         "page16 default": dict(page=16)}
CALLS = {n: run(kw) for n, kw in TILES.items()}
lens = [8192, 1, 4099, 777, 3000]
for name in list(CALLS):
    page = CALLS[name].page
    kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, 256 // page, dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
    want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
    try:
        got = CALLS[name](q, kc, vc, cl, bt, ks, vs).double()
        err = float((got - want).norm() / want.norm())
        print(f"check page{page} {name}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
    except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
        print(f"check page{page} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del CALLS[name]
for ctx in (2048, 8192, 32768):
    caches = {p: fp8_paged(b, ctx, hkv, d, p, 256 // p, dev) for p in (16, 128)}
    q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
    nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
    fns = {}
    for n, c in CALLS.items():
        kc, vc, ks, vs, cl, bt = caches[c.page]
        fns[n] = partial(c, q, kc, vc, cl, bt, ks, vs)
    fns["copy"] = same_traffic_copy(dev, nbytes)
    times = rotated_times(fns)
    for line in vs_copy_lines(times, lambda n, ctx=ctx: f"fp8 decode ctx{ctx} page{CALLS[n].page} {n}"):
        print(line, flush=True)
    del fns, caches
    torch.cuda.empty_cache()
