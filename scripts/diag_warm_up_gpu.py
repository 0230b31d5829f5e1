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

MIX = ["mode=monolithic", "decode=tp1", "decode.device=cuda", "drafter=dspark", "tracking=off"]
SKIP = ("grid", "warmup", "num_warps", "num_stages")


def _class(v) -> str:
    """What Triton specializes a launch argument on."""
    if hasattr(v, "data_ptr"):
        return f"{v.dtype}{'' if v.data_ptr() % 16 == 0 else '@unaligned'}"
    if isinstance(v, float):
        return "f"
    if isinstance(v, bool) or not isinstance(v, int):
        return repr(v)
    return "1" if v == 1 else "16x" if v % 16 == 0 else "i"


def main() -> None:
    import pdflow.kernels.decode_attention as da

    from pdflow import Deployment, SamplingParams, compose

    names = list(inspect.signature(da._paged_split_kernel.fn).parameters)
    seen, phase = {}, ["warm"]
    launch = da._paged_split_kernel.run

    def logged(*args, **kw):
        key = tuple(f"{n}={_class(a)}" for n, a in zip(names, args, strict=False))
        key += tuple(f"{n}={v}" for n, v in sorted(kw.items()) if n not in SKIP)
        seen.setdefault(key, phase[0])
        return launch(*args, **kw)

    da._paged_split_kernel.run = logged
    with Deployment(compose(MIX)) as d:
        phase[0] = "request"
        vocab = d.vocab_size
        prompts = [[3 + (7 * i + n) % (vocab - 3) for i in range(n)] for n in (1, 5, 37, 130, 300, 700, 16, 64)]
        greedy = SamplingParams(temperature=0, max_tokens=40)
        d.generate(prompts, greedy)
        for p in prompts[:3]:
            d.generate([p], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1))
        d.generate([prompts[5] + prompts[2]], greedy)
    warm = [k for k, v in seen.items() if v == "warm"]
    for key, when in seen.items():
        if when == "request":  # beside the warm-up key that differs in the fewest fields
            best = min(warm, key=lambda w, key=key: sum(a != b for a, b in zip(w, key, strict=False)))
            print("new:", [f for f in key if f not in best], "nearest warm-up key:", [f for f in best if f not in key])


if __name__ == "__main__":
    main()
