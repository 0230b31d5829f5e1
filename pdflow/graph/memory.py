"""How many bytes each rank may use: the graph's sizing of every pool, like vLLM's
``gpu_memory_utilization``.

``memory`` is a fraction of the rank's device (or, above 1, bytes). The device's size is
``device_memory_gib`` when given (an override), else on cuda the GPU's total read when the
run starts (``DeviceFacts``), else the described size (``pdflow plan`` on a machine
without the GPU: ``DESCRIBED_GPU_GIB``; cpu: ``CPU_GIB``). Unset, ``memory`` is 0.9 of a
GPU split between the ranks of the run that share it (0.1 on cpu, the old default), so
the one-GPU P/D command gives each instance 0.45. With facts, the ranks this process
starts must fit in what the GPU has free at start (``DEVICE_MEMORY_SHORT``).
"""

from __future__ import annotations

from collections import Counter

from pdflow.graph.devices import DeviceFacts
from pdflow.graph.placement import CONSUMER, PRODUCER, InstancePlan, parallel_of
from pdflow.graph.refusals import Code, Refusal
from pdflow.spec import ParallelSpec, RunSpec

GIB = 1 << 30
CPU_GIB = 4.0
DESCRIBED_GPU_GIB = 80.0
DEFAULT_FRACTION = {"cpu": 0.1}
GPU_FRACTION = 0.9


def _default_fraction(par: ParallelSpec) -> float:
    return DEFAULT_FRACTION.get(par.device, GPU_FRACTION)


def device_bytes(par: ParallelSpec, index: int, devices: DeviceFacts | None) -> tuple[int, str]:
    """The size of a rank's device and where it came from."""
    if par.device_memory_gib is not None:
        return int(par.device_memory_gib * GIB), "device_memory_gib"
    if par.device == "cpu":
        return int(CPU_GIB * GIB), "cpu, described"
    gpu = devices.gpu(index) if devices is not None and par.device == "cuda" else None
    if gpu is not None:
        return gpu.total_bytes, f"GPU {index}, read at start"
    return int(DESCRIBED_GPU_GIB * GIB), "described, no GPU read"


def sharers(instances: list[InstancePlan], spec: RunSpec) -> Counter:
    """GPU index -> how many ranks of the run's instances sit on it (gpu sides only)."""
    out = Counter()
    for plan in instances:
        if parallel_of(spec, plan.role).device != "cpu":
            out.update(r.device_index for r in plan.ranks)
    return out


def rank_usable(spec: RunSpec, plan: InstancePlan, shared: Counter,
                devices: DeviceFacts | None) -> tuple[dict[int, int], str]:
    """Rank -> bytes it may use, and a line saying how (for ``pdflow plan``)."""
    par = parallel_of(spec, plan.role)
    out, how = {}, ""
    for r in plan.ranks:
        total, source = device_bytes(par, r.device_index, devices)
        if par.memory is not None and par.memory > 1.0:
            out[r.rank], how = int(par.memory), f"{plan.role}.memory {par.memory:g} bytes"
            continue
        split = 1 if par.memory is not None or par.device == "cpu" else shared[r.device_index]
        fraction = (par.memory if par.memory is not None else _default_fraction(par)) / max(1, split)
        out[r.rank] = int(fraction * total)
        given = f"{plan.role}.memory {par.memory:g}" if par.memory is not None else (
            f"memory {_default_fraction(par):g}" + (f" split by {split} ranks sharing the GPU" if split > 1 else ""))
        how = f"{given} = {fraction:.3g} of {total / GIB:.1f} GiB ({source})"
    return out, how


def memory_refusals(spec: RunSpec, plans: dict[str, InstancePlan], usable: dict[str, dict[int, int]],
                    devices: DeviceFacts | None) -> list[Refusal]:
    """GPUs whose free memory at start cannot hold what the ranks this process starts ask."""
    if devices is None:
        return []
    starts = {"prefill": [PRODUCER], "decode": [CONSUMER]}.get(spec.serve.role, list(plans))
    asked: Counter = Counter()
    who: dict[int, list[str]] = {}
    for role in starts:
        plan = plans.get(role)
        if plan is None or parallel_of(spec, role).device != "cuda":
            continue
        for r in plan.ranks:
            asked[r.device_index] += usable[role][r.rank]
            who.setdefault(r.device_index, []).append(r.label)
    out = []
    for index, wanted in sorted(asked.items()):
        gpu = devices.gpu(index)
        if gpu is None or wanted <= gpu.free_bytes:
            continue
        out.append(Refusal(
            code=Code.DEVICE_MEMORY_SHORT,
            message=f"GPU {index} has {gpu.free_bytes / GIB:.1f} GiB free of {gpu.total_bytes / GIB:.1f} GiB at "
            f"start, but {', '.join(who[index])} ask {wanted / GIB:.1f} GiB.",
            fix="lower prefill.memory / decode.memory (fractions of the device, like vLLM's "
            "gpu_memory_utilization), free the GPU, or place the instances on other GPUs (device_offset)."))
    return out
