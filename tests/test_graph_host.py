"""Refusals against the host a command launches on (``pdflow.graph.host``), from facts
given, not probed: the checks are pure. Each must name what this host lacks, and a host
that has it must pass."""

from __future__ import annotations

from pdflow.graph import Code
from pdflow.graph.host import HostFacts, host_refusals

GPUS = ["prefill.device=cuda", "decode.device=cuda", "prefill=tp1", "decode=tp1", "drafter=none"]


def _codes(graph, **facts) -> set[Code]:
    host = HostFacts(**{"cuda_devices": 2, "rdma_devices": ("mlx5_0",), **facts})
    return {r.code for r in host_refusals(graph, host)}


def test_gpus_the_host_lacks_are_refused(graph_of):
    graph = graph_of(*GPUS, "prefill.device_offset=1", "transfer=nccl")
    assert _codes(graph, cuda_devices=1) == {Code.DEVICE_UNAVAILABLE}
    assert _codes(graph, cuda_devices=2) == set()


def test_rdma_the_host_lacks_is_refused(graph_of):
    graph = graph_of(*GPUS, "transfer=mooncake_rdma", "transfer.device=mlx5_0", "transfer.staging=true")
    assert _codes(graph, rdma_devices=()) == {Code.RDMA_UNAVAILABLE}
    assert _codes(graph) == set()


def test_direct_mooncake_writes_from_gpu_caches_need_its_cuda_build(graph_of):
    """Without staging, Mooncake reads every run from the GPU caches itself: its non-CUDA
    build (the one a CPU machine installs) would take a device address for host memory."""
    direct = graph_of(*GPUS, "transfer=mooncake_rdma", "transfer.device=mlx5_0", "transfer.staging=false")
    refused = host_refusals(direct, HostFacts(cuda_devices=2, rdma_devices=("mlx5_0",)))
    assert [r.code for r in refused] == [Code.MOONCAKE_HOST_ONLY]
    assert "transfer.staging=true" in refused[0].fix and "transfer=nccl" in refused[0].fix
    assert _codes(direct, mooncake_reads_gpu=True) == set()
    staged = graph_of(*GPUS, "transfer=mooncake_rdma", "transfer.device=mlx5_0", "transfer.staging=true")
    assert _codes(staged) == set()
    on_cpu = graph_of("prefill=tp1", "decode=tp1", "drafter=none", "transfer=mooncake_rdma",
                      "transfer.device=mlx5_0", "transfer.staging=false")
    assert _codes(on_cpu) == set()
