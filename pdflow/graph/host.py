"""Refusals against the host a command launches on, before anything starts.

``pdflow plan`` plans for the hardware a spec describes (a reference deployment on eight
MI355X GPUs plans on a laptop); ``pdflow run`` and ``pdflow serve`` also need that
hardware here. The facts (``HostFacts``: CUDA devices and RDMA ports) are probed once
by the command and passed in, so the checks themselves are pure and testable.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pdflow.graph.devices import DeviceFacts, cuda_indices
from pdflow.graph.placement import CONSUMER, PRODUCER, parallel_of
from pdflow.graph.refusals import Code, Refusal
from pdflow.graph.run_graph import RunGraph, build_graph

RDMA_SYSFS = Path("/sys/class/infiniband")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostFacts:
    """What this host can run on: CUDA devices, RDMA device names, whether Mooncake is
    installed at all, and whether it can read GPU memory (its CUDA build; the non-CUDA one
    moves host memory only)."""

    cuda_devices: int
    rdma_devices: tuple[str, ...]
    mooncake_reads_gpu: bool = False
    mooncake_installed: bool = True

    @classmethod
    def probe(cls, spec) -> HostFacts:
        """This host's facts; CUDA is counted (torch imported) only when the spec asks for it."""
        cuda = 0
        if "cuda" in (spec.prefill.device, spec.decode.device):
            import torch

            cuda = torch.cuda.device_count()
        rdma = tuple(sorted(p.name for p in RDMA_SYSFS.iterdir())) if RDMA_SYSFS.is_dir() else ()
        return cls(cuda_devices=cuda, rdma_devices=rdma, mooncake_reads_gpu=distribution_installed(MOONCAKE_CUDA_BUILD),
                   mooncake_installed=importlib.util.find_spec("mooncake") is not None)


def read_devices(spec) -> DeviceFacts | None:
    """The memory of the GPUs ``spec`` places ranks on, read now (None: no cuda side).
    An owner starting two instances reads once, before either allocates, and gives both
    the same facts (``Deployment``)."""
    if "cuda" not in (spec.prefill.device, spec.decode.device):
        return None
    graph = build_graph(spec)
    indices = cuda_indices(graph) if graph.consumer is not None else []
    return DeviceFacts.probe(indices) if indices else None


def host_refusals(graph: RunGraph, host: HostFacts) -> list[Refusal]:
    """Every reason ``graph`` cannot launch on ``host`` (empty when it can)."""
    spec, out = graph.spec, []
    if graph.consumer is None or (spec.mode == "pd" and graph.producer is None):
        return out  # refused by its structure already
    for role in [CONSUMER] if spec.mode == "monolithic" else [PRODUCER, CONSUMER]:
        par = parallel_of(spec, role)
        plan = graph.instance(role)
        if par.device == "cpu":
            continue
        if par.device != "cuda":
            out.append(Refusal(code=Code.DEVICE_UNAVAILABLE,
                               message=f"{role}.device={par.device} describes hardware this command cannot "
                               "launch on (it runs on cpu or cuda); the spec is a plan of another deployment.",
                               fix=f"plan it with `pdflow plan`, or run with {role}.device=cpu|cuda."))
            continue
        last = max(r.device_index for r in plan.ranks)
        if last >= host.cuda_devices:
            out.append(Refusal(code=Code.DEVICE_UNAVAILABLE,
                               message=f"{role} rank on GPU {last} but this host has {host.cuda_devices} CUDA "
                               "device(s).",
                               fix=f"use fewer ranks, set {role}.device_offset, or {role}.device=cpu."))
    if spec.mode == "pd" and spec.transfer.protocol == "rdma":
        wanted = [d for d in spec.transfer.device.split(",") if d]
        missing = [d for d in wanted if d not in host.rdma_devices] if wanted else ["(none named)"]
        if missing:
            have = ", ".join(host.rdma_devices) or "none"
            out.append(Refusal(code=Code.RDMA_UNAVAILABLE,
                               message=f"transfer.protocol=rdma over {', '.join(missing)}, but this host's RDMA "
                               f"devices are: {have}.",
                               fix="use transfer=mooncake_tcp, or set transfer.device to a device listed in "
                               f"{RDMA_SYSFS}."))
    devices = {spec.prefill.device, spec.decode.device}
    if spec.mode == "pd" and spec.transfer.backend == "mooncake" and not host.mooncake_installed:
        wheel = MOONCAKE_CUDA_BUILD if "cuda" in devices else MOONCAKE_CPU_BUILD
        chosen = f" ({spec.transfer.chosen})" if spec.transfer.chosen else ""
        out.append(Refusal(code=Code.TRANSFER_UNAVAILABLE,
                           message=f"transfer.backend=mooncake{chosen} moves the KV, but the Mooncake Transfer "
                           "Engine is not installed here (no `mooncake` module).",
                           fix=f"`pip install {wheel}` (or `pip install -e \".[transfer-"
                           f"{'cuda' if 'cuda' in devices else 'cpu'}]\"`), or run both instances on GPUs of "
                           "this host with transfer=cuda_ipc or transfer=nccl."))
    if (spec.mode == "pd" and spec.transfer.backend == "mooncake" and not spec.transfer.staging
            and "cuda" in devices and not host.mooncake_reads_gpu):
        out.append(Refusal(code=Code.MOONCAKE_HOST_ONLY,
                           message="transfer.staging=false has Mooncake write every run straight from the GPU "
                           f"caches, but the Mooncake installed here is not its CUDA build ({MOONCAKE_CUDA_BUILD}): "
                           "it moves host memory only.",
                           fix="set transfer.staging=true (runs packed on the GPU and staged through pinned host "
                           f"memory), use transfer=nccl between GPUs of one host, or install {MOONCAKE_CUDA_BUILD}."))
    return out


MOONCAKE_CUDA_BUILD = "mooncake-transfer-engine"
MOONCAKE_CPU_BUILD = "mooncake-transfer-engine-non-cuda"


def distribution_installed(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True
