"""GPU memory facts (total and free bytes per GPU), read once when a run starts and
passed into the graph, which sizes every pool from them (``graph/memory.py``).

Like ``HostFacts`` they are host facts, probed outside the graph so the sizing stays pure
and testable with described facts; a run's owner probes once, before either instance
allocates, and hands the same facts to every rank (``RankContext.devices``), so every
rank of an instance sizes the same pool. ``pdflow plan`` probes nothing and plans for the
described hardware.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuMemory:
    index: int
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceFacts:
    gpus: tuple[GpuMemory, ...] = ()

    def gpu(self, index: int) -> GpuMemory | None:
        return next((g for g in self.gpus if g.index == index), None)

    @classmethod
    def probe(cls, indices: Iterable[int]) -> DeviceFacts:
        """Total and free bytes of these GPUs now: through NVML when it is installed (no
        CUDA context in this process), else torch (a context on each probed GPU)."""
        wanted = sorted(set(indices))
        try:
            return cls(gpus=tuple(_own_cache_free(_nvml(i)) for i in wanted))
        except Exception:  # no pynvml, no driver library, NVMLError_*: ask torch instead
            pass
        import torch

        out = []
        for i in wanted:
            if i < torch.cuda.device_count():
                free, total = torch.cuda.mem_get_info(i)
                out.append(_own_cache_free(GpuMemory(index=i, total_bytes=total, free_bytes=free)))
        return cls(gpus=tuple(out))


def _own_cache_free(gpu: GpuMemory) -> GpuMemory:
    """Count as free what this process's torch allocator holds cached but unused (an
    instance shut down earlier in this process): the next pool reuses it."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return gpu
    idle = torch.cuda.memory_reserved(gpu.index) - torch.cuda.memory_allocated(gpu.index)
    return GpuMemory(index=gpu.index, total_bytes=gpu.total_bytes,
                     free_bytes=min(gpu.total_bytes, gpu.free_bytes + max(0, idle)))


def _nvml(index: int) -> GpuMemory:
    import pynvml

    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
    finally:
        pynvml.nvmlShutdown()
    return GpuMemory(index=index, total_bytes=int(info.total), free_bytes=int(info.free))


def cuda_indices(graph) -> list[int]:
    """The GPU indices a run graph's cuda instances use (what the owner probes)."""
    from pdflow.graph.placement import parallel_of

    out = set()
    for plan in (graph.producer, graph.consumer):
        if plan is not None and parallel_of(graph.spec, plan.role).device == "cuda":
            out.update(r.device_index for r in plan.ranks)
    return sorted(out)
