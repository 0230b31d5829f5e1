import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, "scratch_fp8")
import kernel_bench  # noqa
import torch
from kernel_bench.fp8 import fp8_paged
from pdflow.kernels.decode_attention import decode_attention
import da_old
b, hq, hkv, d, ctx = 64, 32, 8, 128, 8192
kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, 16, 8, "cuda")
q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
fns = [lambda: decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs),
       lambda: da_old.decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs)]
for fn in fns: fn()
torch.cuda.synchronize()
for fn in fns: fn()
torch.cuda.synchronize()
print("profiled: new, old (page 16, 8K)")
