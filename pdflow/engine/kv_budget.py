"""How many KV blocks an instance gets. The run graph will own this; until then this is
the one place that derives it."""

from __future__ import annotations

import os

import torch

from pdflow.spec import ParallelSpec
from pdflow.spec.parallel import GIB

# Left for activations and allocator slack, as a fraction of the usable bytes.
ACTIVATION_RESERVE = 0.1


def available_bytes(parallel: ParallelSpec, device: torch.device) -> int:
    """Bytes this instance may use: ``memory`` bytes, or that fraction of the device
    (CUDA: the GPU's total; CPU: device_memory_gib, never more than the free RAM)."""
    if parallel.memory > 1.0:
        return int(parallel.memory)
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        total = min(free_ram, parallel.device_memory_gib * GIB)
    return int(parallel.memory * total)


def derive_num_kv_blocks(
    parallel: ParallelSpec, *, bytes_per_block: int, weight_bytes: int, max_model_len: int,
    device: torch.device,
) -> int:
    """``parallel.num_kv_blocks`` when set; else what fits after weights and a reserve,
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use."""
    if parallel.num_kv_blocks is not None:
        return parallel.num_kv_blocks
    usable = available_bytes(parallel, device) * (1 - ACTIVATION_RESERVE) - weight_bytes
    fits = int(usable // bytes_per_block)
    if fits < 1:
        raise ValueError(
            f"no room for KV blocks: {usable / 2**30:.2f} GiB left after weights, "
            f"{bytes_per_block} bytes per block; raise memory or set num_kv_blocks"
        )
    per_seq = -(-max_model_len // parallel.block_size)
    return min(fits, parallel.max_num_seqs * per_seq)
