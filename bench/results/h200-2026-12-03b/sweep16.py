import sys
sys.path.insert(0, "scripts")
import torch, triton.testing
from functools import partial
from kernel_bench.fp8 import fp8_paged, fp8_decode_bytes
from pdflow.kernels.decode_attention import decode_attention
bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
n = 1 << 30
x = torch.empty(n, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
base = 2 * n / bench(lambda: y.copy_(x)) / 1e9
print(f"copy {base:.3f} TB/s"); del x, y
b, hq, hkv, d = 64, 32, 8, 128
for ctx in (2048, 8192, 32768):
    for page, ppb in ((16, 8), (128, 1)):
        kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, "cuda")
        q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
        nb = fp8_decode_bytes(b, ctx, hq, hkv, d)
        want = decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs)
        for rep in range(2):
            line = f"ctx{ctx} page{page} rep{rep}:"
            for bn, w, st in ((None, None, None), (128, 4, 2), (128, 4, 1), (128, 2, 2), (128, 2, 3), (128, 8, 2)):
                fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, block_n=bn, num_warps=w, num_stages=st)
                same = torch.equal(fn(), want)
                ms = bench(fn)
                line += f"  {'default' if bn is None else f'w{w}st{st}'} {nb / ms / 1e9 / base:.3f}{'' if same else '!'}"
            print(line, flush=True)
