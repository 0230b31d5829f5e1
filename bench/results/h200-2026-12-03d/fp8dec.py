"""Device probe: fp8 decode at 2K/8K, default tiles re-timed (do_bench and CUDA graphs), then a tile sweep."""
import sys, itertools, json
sys.path.insert(0, "scripts"); sys.path.insert(0, "scripts/kernel_bench")
from functools import partial
import torch, triton
import triton.testing as tt
from kernel_bench.fp8 import fp8_paged, fp8_decode_bytes
from kernel_bench.shapes import PAGES, heads, DT
from pdflow.kernels.decode_attention import decode_attention, decode_tiles
class R: tiny = False
hq, hkv, d = heads(R)
b = 64
out = {}
def graph_ms(fn):
    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))
def bench_ms(fn):
    return float(tt.do_bench(fn, warmup=10, rep=60, return_mode="median"))
for ctx in (2048, 8192):
    for page, ppb in PAGES:
        kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, "cuda")
        q = torch.randn(b, hq, d, dtype=DT, device="cuda")
        nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
        src = torch.randn(nbytes // 4, device="cuda").to(DT); dst = torch.empty_like(src)
        cp = lambda: dst.copy_(src)
        fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs)
        for rep in range(3):
            c_b, f_b, c_g, f_g = bench_ms(cp), bench_ms(fn), graph_ms(cp), graph_ms(fn)
            print(f"ctx{ctx} page{page} rep{rep}: do_bench copy {c_b:.4f} dec {f_b:.4f} -> {c_b/f_b:.3f} | graph copy {c_g:.4f} dec {f_g:.4f} -> {c_g/f_g:.3f}", flush=True)
        out[f"{ctx}_{page}"] = {"copy_g": c_g, "def_g": f_g}
        res = []
        for bn, w, st, sp in itertools.product((64, 128, 256), (2, 4, 8), (2, 3, 4), (1, 2)):
            if bn < page and page == 128: pass
            g = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, block_n=bn, num_warps=w, num_stages=st, num_splits=sp)
            try:
                ms = graph_ms(g)
            except Exception as e:
                print("fail", bn, w, st, sp, type(e).__name__, flush=True); continue
            res.append((ms, bn, w, st, sp))
        res.sort()
        for ms, bn, w, st, sp in res[:6]:
            print(f"  ctx{ctx} page{page} bn{bn} w{w} st{st} sp{sp}: {ms:.4f} -> vs graph copy {c_g/ms:.3f}", flush=True)
        out[f"{ctx}_{page}"]["sweep"] = res
        print(f"  default tiles: {decode_tiles(quant=True, page=page, block_m=16, nx=0, itemsize=2, cuda=True)}", flush=True)
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8dec.json"), "w"))
