"""fp8 decode at page 128 read a page at a time (fp8_stages.log: bn256 w4 st2, K and V as
[pages, ...] with no token mask, read 0.854 / 0.890 / 0.904x a same-traffic copy at 2K / 8K /
32K against the default's 0.853 / 0.836 / 0.834): tiles around it, and one page a tile (the
page-at-a-time loop forced at page == tile through a wrapped ``decode_tiles``), against the
default, B64, 32 q / 8 KV heads, d128, CUDA graphs, three rotated rounds with the SM copy of
the same bytes; medians. Checks every tile against the reference first."""
import dataclasses
import sys
from functools import partial

import torch

sys.path.insert(0, "scripts")
import pdflow.kernels.decode_attention as da  # noqa: E402
from kernel_bench.fp8 import fp8_decode_bytes, fp8_paged  # noqa: E402
from kernel_bench.rotated import rotated_times, same_traffic_copy, vs_copy_lines  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402

FORCE = {"on": False}
_tiles = da.decode_tiles


def tiles_forced(**kw):
    t = _tiles(**kw)
    return dataclasses.replace(t, v_pages=True) if FORCE["on"] else t


da.decode_tiles = tiles_forced


def run(kw):
    force = kw.pop("force", False)

    def call(q, kc, vc, cl, bt, ks, vs):
        FORCE["on"] = force
        try:
            return da.decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw)
        finally:
            FORCE["on"] = False
    return call


dev, b, hq, hkv, d, page, ppb = "cuda", 64, 32, 8, 128, 128, 2
TILES = {"default": {}}
for bn, w, st in ((256, 4, 2), (256, 4, 3), (256, 8, 2), (256, 2, 2), (512, 4, 2), (512, 8, 2)):
    TILES[f"bn{bn} w{w} st{st}"] = dict(block_n=bn, num_warps=w, num_stages=st)
for w, st in ((4, 4), (4, 3), (4, 2), (2, 3)):
    TILES[f"bn128 w{w} st{st} paged"] = dict(block_n=128, num_warps=w, num_stages=st, force=True)
CALLS = {n: run(dict(kw)) for n, kw in TILES.items()}
lens = [8192, 1, 4099, 777, 3000]
kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, ppb, dev)
cl = torch.tensor(lens, dtype=torch.int32, device=dev)
q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
for name in list(CALLS):
    try:
        got = CALLS[name](q, kc, vc, cl, bt, ks, vs).double()
        err = float((got - want).norm() / want.norm())
        print(f"check page{page} {name}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
    except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
        print(f"check page{page} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del CALLS[name]
for ctx in (2048, 8192, 32768):
    kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, dev)
    q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
    nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
    fns = {n: partial(c, q, kc, vc, cl, bt, ks, vs) for n, c in CALLS.items()}
    fns["copy"] = same_traffic_copy(dev, nbytes)
    times = rotated_times(fns)
    for line in vs_copy_lines(times, lambda n, ctx=ctx, page=page: f"fp8 decode ctx{ctx} page{page} {n}"):
        print(line, flush=True)
    del fns, kc, vc, ks, vs
    torch.cuda.empty_cache()
