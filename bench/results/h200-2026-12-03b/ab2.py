"""Repeated A/B of the fp8 decode: V per page ([pages, D, page]) vs per tile, and 321377d; the fp8 write then and now."""
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, "scratch")
import torch, triton.testing
from functools import partial
from kernel_bench.fp8 import fp8_paged, fp8_decode_bytes
import kernels_old.decode_attention as old
import kernels_old.store_kv as old_store
from pdflow.kernels import decode_attention as new
from pdflow.kernels.store_kv import store_kv
from pdflow.kernels.kv_quant import FP8
dev = "cuda"
b, hq, hkv, d = 64, 32, 8, 128
x = torch.empty(1 << 30, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
copy = 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e9
print(f"copy {copy:.3f} TB/s", flush=True)
del x, y
for rep in range(3):
    for ctx in (2048, 8192, 32768):
        for page, ppb in ((16, 8), (128, 1)):
            kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, dev)
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=dev)
            nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
            v = {"old": partial(old.decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs),
                 "now": partial(new.decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs)}
            if page == 16:
                v["now_tileV"] = partial(new.decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, v_pages=False)
            want = v["old"]()
            line = f"rep{rep} ctx{ctx} page{page}"
            for name, fn in v.items():
                err = float((fn().float() - want.float()).abs().max())
                ms = bench(fn)
                line += f"  {name} {ms:.4f}ms {nbytes / ms / 1e9 / copy:.3f}x (diff {err:.1e})"
            print(line, flush=True)
for n in (8192, 65536):
    k = torch.randn(n, hkv, d, dtype=torch.bfloat16, device=dev); vv = torch.randn_like(k)
    slots = torch.arange(n, device=dev)
    for page, ppb in ((16, 8), (128, 1)):
        shape = (n // (page * ppb) + 1, ppb, hkv, page)
        k8, v8 = (torch.zeros((*shape, d), dtype=FP8, device=dev) for _ in range(2))
        ks, vs = (torch.zeros((*shape, 1), dtype=torch.uint8, device=dev) for _ in range(2))
        a = bench(partial(old_store.store_kv, k, vv, k8, v8, slots, ks, vs))
        bms = bench(partial(store_kv, k, vv, k8, v8, slots, ks, vs))
        print(f"store fp8 N{n} page{page}: old {a:.4f} ms, now {bms:.4f} ms ({a / bms:.3f}x)", flush=True)
