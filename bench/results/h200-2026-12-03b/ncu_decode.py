import sys
sys.path.insert(0, "scripts")
import torch
from kernel_bench.fp8 import fp8_paged
from pdflow.kernels.decode_attention import decode_attention
b, hq, hkv, d, ctx = 64, 32, 8, 128, 8192
cases = []
for page, ppb, vp in ((16, 8, None), (16, 8, False), (128, 1, None)):
    kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, "cuda")
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
    cases.append(lambda q=q, kc=kc, vc=vc, cl=cl, bt=bt, ks=ks, vs=vs, vp=vp:
                 decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, v_pages=vp))
for fn in cases:
    fn()
torch.cuda.synchronize()
for fn in cases:
    fn()
torch.cuda.synchronize()
print("page16 vpages, page16 plain, page128")
