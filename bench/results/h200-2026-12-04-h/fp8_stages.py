"""fp8 decode tiles at pages 128 and 16 (issue 35: 0.87-0.91x a same-traffic copy in the
bench, 0.92-0.95x in probes): the default launch against other stages, warps, tile sizes and
splits, at the bench's shape (B64, 32 q / 8 KV heads, d128), 2K / 8K / 32K, in CUDA graphs,
every candidate and the SM copy of the same bytes timed in three rounds of rotated order;
medians. Checks each tile against the reference first."""
import sys
from functools import partial

import torch

sys.path.insert(0, "scripts")
from kernel_bench.fp8 import fp8_decode_bytes, fp8_paged  # noqa: E402
from kernel_bench.rotated import rotated_times, same_traffic_copy, vs_copy_lines  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402

dev, b, hq, hkv, d = "cuda", 64, 32, 8, 128
TILES = {
    128: {"default": {}, "bn128 w4 st3": dict(block_n=128, num_warps=4, num_stages=3),
          "bn128 w4 st2": dict(block_n=128, num_warps=4, num_stages=2),
          "bn128 w8 st3": dict(block_n=128, num_warps=8, num_stages=3),
          "bn256 w4 st2": dict(block_n=256, num_warps=4, num_stages=2),
          "bn64 w2 st4": dict(block_n=64, num_warps=2, num_stages=4),
          "splits2": dict(num_splits=2)},
    16: {"default": {}, "bn128 w2 st3": dict(block_n=128, num_warps=2, num_stages=3),
         "bn256 w4 st2": dict(block_n=256, num_warps=4, num_stages=2),
         "bn256 w2 st2": dict(block_n=256, num_warps=2, num_stages=2)},
}
lens = [8192, 1, 4099, 777, 3000]
for page, tiles in TILES.items():
    ppb = 256 // page
    kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, ppb, dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
    want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
    for name, kw in list(tiles.items()):
        try:
            got = decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw).double()
            err = float((got - want).norm() / want.norm())
            print(f"check page{page} {name}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
        except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
            print(f"check page{page} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            del tiles[name]
for ctx in (2048, 8192, 32768):
    for page, tiles in TILES.items():
        kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, 256 // page, dev)
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
        fns = {n: partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw) for n, kw in tiles.items()}
        fns["copy"] = same_traffic_copy(dev, nbytes)
        times = rotated_times(fns)
        for line in vs_copy_lines(times, lambda n, ctx=ctx, page=page: f"fp8 decode ctx{ctx} page{page} {n}"):
            print(line, flush=True)
        del fns, kc, vc, ks, vs
        torch.cuda.empty_cache()
