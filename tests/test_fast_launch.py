"""``FastLaunch``'s key: a compiled kernel is launched again only for arguments Triton
would have compiled the same way (a wrong key would run a kernel specialized for other
values, silently). The launch itself is checked on the H200 by the Gluon prefill tests,
which go through it with varying shapes (test_kernels_prefill_gluon.py)."""

from __future__ import annotations

import torch
from pdflow.kernels.interpreter import use_interpreter_if_no_cuda

use_interpreter_if_no_cuda()  # before any kernel module is imported (as every kernel test)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from pdflow.kernels.fast_launch import FastLaunch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def _body(x_ptr, n, m, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + m, mask=i < n)


COMPILED = FastLaunch(JITFunction(_body, do_not_specialize=["m"]))  # never launched: keys only


def key(x, n, m, b=16, **options):
    return COMPILED.key(0, (x, n, m, b), options)


def test_the_key_separates_what_triton_specializes_on():
    x = torch.zeros(64)
    assert key(x, 2, 5) == key(x, 3, 7)            # neither 1 nor a multiple of 16: one kernel
    assert key(x, 1, 5) != key(x, 2, 5)            # n == 1 is compiled in as a constant
    assert key(x, 32, 5) != key(x, 33, 5)          # n % 16 == 0 is a divisibility hint
    assert key(x, 2, 1) == key(x, 2, 2)            # m is do_not_specialize
    assert key(x, 2**33, 5) != key(x, 2**4 + 1, 5)  # an int64 value is another signature
    assert key(x[1:], 2, 5) != key(x, 2, 5)        # a pointer off 16-byte alignment
    assert key(x.double(), 2, 5) != key(x, 2, 5)   # dtype
    assert key(x, 2, 5, b=32) != key(x, 2, 5)      # a constexpr's value
    assert key(x, 2, 5, num_warps=8) != key(x, 2, 5, num_warps=4)


def test_an_interpreted_kernel_runs_through_triton_and_is_never_cached():
    if torch.cuda.is_available():
        return  # the interpreter is for CPU runs; the GPU path is the Gluon tests'
    launch = FastLaunch(triton.jit(_body))
    x = torch.arange(8, dtype=torch.float32)
    for _ in range(2):
        launch(0, (1,), (x, 5, 10, 8), {})
    assert x.tolist() == [20, 21, 22, 23, 24, 5, 6, 7]
    assert launch.compiled == {}
