"""fp8 decode under a register cap (``maxnreg``): the page-16 loop holds 255 registers a
thread at two warps (4 programs an SM, ~2 warps a scheduler: latency-bound, KERNEL_NOTES row
53); capped, more programs fit an SM, if the spills cost less than the latency they hide.
Pages 16 and 128 at their defaults against caps of 168 and 128, B64, 32 q / 8 KV heads, d128,
2K / 8K / 32K, CUDA graphs, three rotated rounds with the SM copy of the same bytes; medians."""
import sys
from functools import partial

import torch

sys.path.insert(0, "scripts")
from kernel_bench.fp8 import fp8_decode_bytes, fp8_paged  # noqa: E402
from kernel_bench.rotated import rotated_times, same_traffic_copy, vs_copy_lines  # noqa: E402
from pdflow.kernels import reference as ref  # noqa: E402
from pdflow.kernels.decode_attention import decode_attention  # noqa: E402

dev, b, hq, hkv, d = "cuda", 64, 32, 8, 128
CAPS = {"default": {}, "maxnreg 168": dict(maxnreg=168), "maxnreg 128": dict(maxnreg=128)}
lens = [8192, 1, 4099, 777, 3000]
for page in (16, 128):
    kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, 256 // page, dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, device=dev).to(torch.bfloat16)
    want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
    for name, kw in CAPS.items():
        got = decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw).double()
        err = float((got - want).norm() / want.norm())
        print(f"check page{page} {name}: rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
for ctx in (2048, 8192, 32768):
    for page in (16, 128):
        kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, 256 // page, dev)
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        nbytes = fp8_decode_bytes(b, ctx, hq, hkv, d)
        fns = {n: partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, **kw) for n, kw in CAPS.items()}
        fns["copy"] = same_traffic_copy(dev, nbytes)
        times = rotated_times(fns)
        for line in vs_copy_lines(times, lambda n, ctx=ctx, page=page: f"fp8 decode ctx{ctx} page{page} {n}"):
            print(line, flush=True)
        del fns, kc, vc, ks, vs
        torch.cuda.empty_cache()
# registers and spills of the compiled variants (the launched kernels this process holds)
from pdflow.kernels.decode_attention import _paged_split_kernel  # noqa: E402

try:
    for dev_cache in _paged_split_kernel.device_caches.values():
        for k in dev_cache[0].values():
            print(f"compiled: warps {k.metadata.num_warps} stages {k.metadata.num_stages} maxnreg "
                  f"{getattr(k.metadata, 'maxnreg', None)}: {k.n_regs} registers, {k.n_spills} spills", flush=True)
except Exception as e:  # the cache's shape differs between triton versions: report, do not fail
    print(f"compiled kernels not listed: {type(e).__name__}: {e}")
