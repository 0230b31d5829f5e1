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
print(f"copy {base:.3f} TB/s")
for frag in (512, 1024, 2048, 4096, 16384, 131072):
    rows = n // frag
    xs, ys = x.view(torch.int64).view(rows, -1), y.view(torch.int64).view(rows, -1)
    idx = torch.randperm(rows, device="cuda")
    tb = 2 * n / bench(partial(torch.index_select, xs, 0, idx, out=ys)) / 1e9
    print(f"gather of {frag}-byte rows in random order: {tb:.3f} TB/s = {tb / base:.3f}x copy")
del x, y
b, hq, hkv, d = 64, 32, 8, 128
for ctx in (2048, 8192):
    kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, 16, 8, "cuda")
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
    nb = fp8_decode_bytes(b, ctx, hq, hkv, d)
    ref = bench(partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs))
    print(f"ctx{ctx} page16 default {ref:.4f} ms {nb / ref / 1e9 / base:.3f}x copy")
    for bn, w, st in ((128, 8, 4), (128, 4, 3), (128, 4, 2), (64, 4, 4), (256, 8, 3), (256, 4, 2)):
        try:
            ms = bench(partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, block_n=bn, num_warps=w, num_stages=st))
            print(f"ctx{ctx} page16 bn{bn} w{w} st{st} {ms:.4f} ms {nb / ms / 1e9 / base:.3f}x copy, {ref / ms:.3f}x default")
        except Exception as e:
            print(f"ctx{ctx} bn{bn} w{w} st{st} failed: {type(e).__name__} {str(e)[:100]}")
