"""GPU placement comes from the run graph: prefill ranks from GPU 0, decode ranks right
after them (or from an instance's device_offset), and the rank worker uses the graph's
index instead of computing one. No GPU needed: CUDA calls are stubbed."""

from __future__ import annotations

import pytest
import torch

from pdflow.engine.llm import run_spec_for
from pdflow.graph import build_graph
from pdflow.parallel.launcher import RankContext
from pdflow.parallel.rendezvous import StoreAddress
from pdflow.spec import ModelSpec, ParallelSpec
from pdflow.spec.load import compose_spec
from pdflow.worker import rank_loop
from pdflow.worker import stage as worker_stage

CUDA_PP4_TP4 = ("prefill=pp4", "decode=tp4", "prefill.device=cuda", "decode.device=cuda")


def devices(graph, role: str) -> list[int]:
    return [r.device_index for r in graph.instance(role).ranks]


def test_pp4_prefill_then_tp4_decode_take_gpus_0_to_7(graph_of):
    graph = graph_of("prefill=pp4", "decode=tp4").raise_if_refused()
    prefill = graph.instance("prefill")
    assert [(r.stage, r.device_index) for r in prefill.ranks] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    decode = graph.instance("decode")
    assert [(r.tp_rank, r.device_index) for r in decode.ranks] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    data = graph.to_dict()
    assert [r["device_index"] for s in data["consumer"]["stages"] for r in s["ranks"]] == [4, 5, 6, 7]


def test_decode_base_follows_the_prefill_world_size(graph_of):
    graph = graph_of("prefill=tp2", "prefill.pp=2", "decode=tp2").raise_if_refused()
    assert devices(graph, "prefill") == [0, 1, 2, 3]  # rank = stage * tp + tp_rank
    assert devices(graph, "decode") == [4, 5]


def test_a_monolithic_decode_starts_at_gpu_0(graph_of):
    """No prefill instance runs, so nothing holds GPUs 0-3."""
    assert devices(graph_of("prefill=pp4", "decode=tp4", "mode=monolithic").raise_if_refused(), "decode") == [
        0, 1, 2, 3]


def test_device_offset_overrides_each_side(graph_of):
    graph = graph_of("prefill=pp4", "decode=tp4", "decode.device_offset=0", "prefill.device_offset=2")
    graph = graph.raise_if_refused()
    assert devices(graph, "prefill") == [2, 3, 4, 5]
    assert devices(graph, "decode") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="device_offset"):
        ParallelSpec(device_offset=-1)


def test_one_instance_llm_spec_starts_at_gpu_0():
    model = ModelSpec(name="t", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=100, max_model_len=256)
    par = ParallelSpec(tp=2, block_size=16, kv_page_tokens=8, num_kv_blocks=16)
    graph = build_graph(run_spec_for(model, par)).raise_if_refused()
    assert devices(graph, "decode") == [0, 1]
    assert par.device_offset is None  # the caller's spec is not modified
    shifted = ParallelSpec(tp=2, block_size=16, kv_page_tokens=8, num_kv_blocks=16, device_offset=6)
    assert devices(build_graph(run_spec_for(model, shifted)), "decode") == [6, 7]


def test_rank_device_is_the_graphs_index(graph_of, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    graph = graph_of(*CUDA_PP4_TP4).raise_if_refused()
    par = graph.spec.decode
    assert [worker_stage.rank_device(par, r) for r in graph.instance("decode").ranks] == [
        torch.device("cuda", i) for i in (4, 5, 6, 7)
    ]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    with pytest.raises(RuntimeError, match=r"decode\.s0\.t3 is placed on GPU 7 but this host has 6"):
        worker_stage.rank_device(par, graph.rank("decode", 3))
    cpu = compose_spec(["prefill=pp4", "decode=tp4"])
    assert worker_stage.rank_device(cpu.decode, graph.rank("decode", 3)) == torch.device("cpu")


class _Stop(Exception):
    pass


def test_serve_rank_sets_the_graphs_gpu(graph_of, monkeypatch):
    """The worker asks the graph, not ``rank % device_count``: with one visible GPU the
    old rule would have put every rank on GPU 0."""
    spec = graph_of(*CUDA_PP4_TP4).spec
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(rank_loop, "join_process_group", stop)
    for rank in range(4):
        ctx = RankContext(spec=spec, role="decode", rank=rank, world_size=4, store=StoreAddress(host="x", port=1))
        with pytest.raises(_Stop):
            rank_loop.serve_rank(ctx, channel=None)
    assert chosen == [torch.device("cuda", i) for i in (4, 5, 6, 7)]


def test_one_instance_llm_spec_counts_only_its_own_ranks_against_free_memory():
    """An ``LLM`` starts its decode instance alone: 0.9 of a GPU with ~0.99 of it free
    fits. (As a two-sided spec the unstarted prefill side's 0.9 was counted too, and
    every one-GPU ``LLM(memory=0.9)`` was refused as DEVICE_MEMORY_SHORT.)"""
    from pdflow.graph.devices import DeviceFacts, GpuMemory

    model = ModelSpec(name="t", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=100, max_model_len=256)
    par = ParallelSpec(block_size=16, num_kv_blocks=16, device="cuda", memory=0.9)
    gib = 1 << 30
    facts = DeviceFacts(gpus=(GpuMemory(index=0, total_bytes=140 * gib, free_bytes=139 * gib),))
    graph = build_graph(run_spec_for(model, par), facts)
    assert not graph.refusals, graph.refusals
    assert graph.producer is None and set(graph.budgets) == {"decode"}
