"""Launching a compiled Triton kernel again without Triton's per-call binding.

Why: ``kernel[grid](...)`` binds every argument, computes the specialization key (for a
Gluon descriptor that includes its layout's repr) and looks the compiled kernel up on
every call: measured with py-spy on the H200's host as about half of the prefill
attention's launch, and a prefill step pays it once per layer between its CUDA-graph
pieces. ``FastLaunch`` remembers the compiled kernel under a key that distinguishes
everything Triton specializes on (each constexpr's value; each integer's ``== 1``,
``% 16 == 0`` and 32-bit range unless the parameter is ``do_not_specialize``; each
pointer's 16-byte alignment; a descriptor's dtype, block shape and layout; every launch
option), so a key never maps to a kernel compiled for other specializations. The first
call of a key goes through Triton (compiling if needed); later calls launch through
``CompiledKernel[grid]``, Triton's own launcher. Under TRITON_INTERPRET there is no
compiled kernel: every call goes through Triton.
"""

from __future__ import annotations

import torch

__all__ = ["FastLaunch"]

_I32 = (-(2**31), 2**31 - 1)


def _spec(value, constexpr: bool, specialize: bool):
    if constexpr:
        return ("c", value)
    if isinstance(value, torch.Tensor):
        return ("t", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        small = _I32[0] <= value <= _I32[1]
        return ("i", small) if not specialize else ("i", small, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("f",)
    if value is None:
        return ("n",)
    base = getattr(value, "base", None)  # a tensor descriptor
    if isinstance(base, torch.Tensor):
        return ("d", base.dtype, base.data_ptr() % 16 == 0, tuple(value.block_shape),
                getattr(value, "layout", None))
    raise TypeError(f"FastLaunch: no key for a {type(value).__name__} argument")


class FastLaunch:
    """``FastLaunch(kernel)(device_index, grid, params, options)``: ``params`` are all of
    the kernel's parameters in order, constexprs included; ``options`` the launch options
    (``num_warps``, ...)."""

    __slots__ = ("fn", "kinds", "compiled")

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)  # None: an interpreted kernel, always through Triton
        self.kinds = None if params is None else [(bool(p.is_constexpr), not p.do_not_specialize)
                                                  for p in params]
        self.compiled: dict[tuple, object] = {}

    def key(self, device_index: int, params: tuple, options: dict) -> tuple:
        """Raises ValueError unless ``params`` has one value per kernel parameter."""
        return (device_index, tuple(_spec(v, c, s) for v, (c, s) in zip(params, self.kinds, strict=True)),
                tuple(sorted(options.items())))

    def __call__(self, device_index: int, grid: tuple, params: tuple, options: dict) -> None:
        if self.kinds is None:
            self.fn[grid](*params, **options)
            return
        key = self.key(device_index, params, options)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.fn[grid](*params, **options)
            return
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*params)
