#!/usr/bin/env python
"""Which decode-kernel specializations a served mix meets after the warm-up (one GPU).

``tests/test_warm_up_gpu.py`` says *that* a kernel compiled inside a request; this says
*which* specialization: it logs every ``_paged_split_kernel`` launch's key (tensor dtypes and
16-byte alignment, each integer's class 1 / multiple of 16 / other, the constexprs) during
the warm-up and during requests, and prints each key first seen in a request beside the
nearest warm-up key. Found the split counts the warm-up missed with DSpark (RESULTS,
"Cold starts"). ``python scripts/diag_warm_up_gpu.py``
"""

import inspect

import pdflow.kernels.decode_attention as da

from pdflow import Deployment, SamplingParams, compose

names = list(inspect.signature(da._paged_split_kernel.fn).parameters)
seen, phase = {}, ["warm"]
orig = da._paged_split_kernel.run
def cls(v):
    if hasattr(v, "data_ptr"):
        return f"{v.dtype}{'' if v.data_ptr() % 16 == 0 else '@unaligned'}"
    if isinstance(v, bool) or not isinstance(v, int):
        return repr(v) if not isinstance(v, float) else "f"
    return "1" if v == 1 else "16x" if v % 16 == 0 else "i"
def run(*args, **kw):
    key = tuple(f"{n}={cls(a)}" for n, a in zip(names, args)) + tuple(
        f"{n}={v}" for n, v in sorted(kw.items()) if n not in ("grid", "warmup", "num_warps", "num_stages"))
    seen.setdefault(key, phase[0])
    return orig(*args, **kw)
da._paged_split_kernel.run = run
with Deployment(compose(["mode=monolithic", "decode=tp1", "decode.device=cuda", "drafter=dspark", "tracking=off"])) as d:
    phase[0] = "request"
    vocab = d.vocab_size
    lengths = [1, 5, 37, 130, 300, 700, 16, 64]
    prompts = [[3 + (7 * i + n) % (vocab - 3) for i in range(n)] for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    d.generate(prompts, greedy); print("after batch:", sum(v == "request" for v in seen.values()))
    for p in prompts[:3]:
        d.generate([p], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1))
    print("after sampled:", sum(v == "request" for v in seen.values()))
    d.generate([prompts[5] + prompts[2]], greedy)
warm = [k for k, v in seen.items() if v == "warm"]
for k, v in seen.items():
    if v == "request":
        # the warm key differing in fewest fields
        best = min(warm, key=lambda w: sum(a != b for a, b in zip(w, k)))
        print("NEW:", [f for f in k if f not in best], "vs warm:", [f for f in best if f not in k])
