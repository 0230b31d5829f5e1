"""transfer=auto, the default: cuda_ipc between GPU caches of one host, Mooncake TCP on CPU
and between separately started instances. A transfer whose package is missing is a
host refusal naming the pip command, before anything launches (never an ImportError at
pairing). The README's GPU commands plan and pass the host checks on a described GPU host
without Mooncake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdflow.graph import Code, build_graph
from pdflow.graph.host import HostFacts, host_refusals
from pdflow.spec.load import compose_spec

README = Path(__file__).resolve().parents[1] / "README.md"
ONE_GPU = ["prefill=tp1", "decode=tp1", "drafter=none", "prefill.device=cuda", "decode.device=cuda",
           "decode.device_offset=0"]
NO_MOONCAKE = HostFacts(cuda_devices=8, rdma_devices=(), mooncake_installed=False)


def _label(*overrides: str) -> str:
    return build_graph(compose_spec(list(overrides))).transfer


def test_auto_is_the_default_and_resolves_from_where_the_caches_live():
    cpu = compose_spec([])
    assert (cpu.transfer.backend, cpu.transfer.protocol, cpu.transfer.staging) == ("mooncake", "tcp", True)
    assert _label() == "mooncake_tcp (auto: CPU caches)"
    one_gpu = compose_spec(ONE_GPU).transfer
    assert (one_gpu.backend, one_gpu.peer_writes) == ("nccl", True)
    assert _label(*ONE_GPU) == "cuda_ipc (auto: GPU caches of one host)"
    two_gpus = ["prefill=tp1", "decode=tp1", "prefill.device=cuda", "decode.device=cuda"]
    assert _label(*two_gpus).startswith("cuda_ipc")
    # Separately started instances may be on two hosts: Mooncake, which crosses them.
    assert _label(*two_gpus, "serve.role=decode") == (
        "mooncake_tcp (auto: instances started separately, maybe on other hosts)")
    # One side on a GPU, the other on CPU: no IPC between them.
    assert _label("prefill=tp1", "decode=tp1", "decode.device=cuda").startswith("mooncake_tcp")


def test_a_named_transfer_is_kept_as_named():
    assert _label(*ONE_GPU, "transfer=mooncake_tcp") == "mooncake_tcp"
    assert _label(*ONE_GPU, "transfer=nccl") == "nccl"
    assert _label("transfer=cuda_ipc") == "cuda_ipc"


def test_mooncake_missing_is_a_host_refusal_naming_the_pip_command():
    on_gpus = build_graph(compose_spec([*ONE_GPU, "transfer=mooncake_tcp"]))
    refused = host_refusals(on_gpus, NO_MOONCAKE)
    assert [r.code for r in refused] == [Code.TRANSFER_UNAVAILABLE]
    assert "pip install mooncake-transfer-engine`" in refused[0].fix
    on_cpu = host_refusals(build_graph(compose_spec([])), NO_MOONCAKE)
    assert [r.code for r in on_cpu] == [Code.TRANSFER_UNAVAILABLE]
    assert "pip install mooncake-transfer-engine-non-cuda" in on_cpu[0].fix
    assert "auto: CPU caches" in on_cpu[0].message
    # Installed, or not needed (monolithic moves no KV; auto on GPUs needs no Mooncake):
    assert host_refusals(on_gpus, HostFacts(cuda_devices=8, rdma_devices=())) == []
    assert host_refusals(build_graph(compose_spec(["mode=monolithic"])), NO_MOONCAKE) == []
    assert host_refusals(build_graph(compose_spec(ONE_GPU)), NO_MOONCAKE) == []


def _readme_gpu_commands() -> list[list[str]]:
    text = README.read_text()
    commands = re.findall(r"`(pdflow run [^`]*?device=cuda[^`]*)`", text, flags=re.S)
    return [c.split()[2:] for c in commands]


def test_the_readme_gpu_commands_run_on_a_gpu_host_without_mooncake():
    commands = _readme_gpu_commands()
    assert len(commands) >= 2, "the README shows a one-GPU and a two-GPU command"
    gpus_needed = set()
    for overrides in commands:
        graph = build_graph(compose_spec(overrides))
        assert graph.refusals == (), (overrides, graph.refusals)
        used = 1 + max(r.device_index for role in ("prefill", "decode") for r in graph.instance(role).ranks)
        gpus_needed.add(used)
        host = HostFacts(cuda_devices=used, rdma_devices=(), mooncake_installed=False)
        assert host_refusals(graph, host) == [], overrides
        assert graph.transfer.startswith("cuda_ipc"), overrides
    assert {1, 2} <= gpus_needed


@pytest.mark.parametrize("transfer", ["mooncake_tcp", "auto"])
def test_the_cpu_default_still_moves_kv_over_mooncake_tcp(transfer):
    t = compose_spec([f"transfer={transfer}"]).transfer
    assert (t.backend, t.protocol, t.staging, t.descriptor_batch) == ("mooncake", "tcp", True, 256)
