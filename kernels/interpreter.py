"""Run the kernels under TRITON_INTERPRET when there is no CUDA device.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the switch has to happen
before the kernel modules are imported; ones imported earlier are reloaded. The
``triton`` backend calls this on import, so it works (slowly) on a CPU machine.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

# Reloaded in this order: a module after the ones it imports kernels from.
KERNEL_MODULES = ("_common", "copy_runs", "store_kv", "decode_attention", "block_attention",
                  "prefill_attention", "prefill_tma", "prefill_gluon", "prefill_auto")


def use_interpreter_if_no_cuda() -> bool:
    """Set TRITON_INTERPRET=1 without a CUDA device (reloading kernel modules already
    imported); True when it did."""
    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    pkg = __name__.rsplit(".", 1)[0]
    for name in KERNEL_MODULES:
        mod = sys.modules.get(f"{pkg}.{name}")
        if mod is not None:
            importlib.reload(mod)
    return True
