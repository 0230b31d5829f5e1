"""``attention_backend: auto`` (the default) resolves in one place: the Triton kernels on a
CUDA device, the torch ops on CPU; a named backend is kept on either device."""

from __future__ import annotations

import pytest

from pdflow.graph import CONSUMER, PRODUCER, parallel_of
from pdflow.spec import ParallelSpec
from pdflow.spec.attention import AUTO, resolve_attention_backend


@pytest.mark.parametrize("device,want", [("cpu", "torch"), ("cuda", "triton"),
                                         ("cuda:1", "triton")])
def test_auto_follows_the_device(device, want):
    assert ParallelSpec().attention_backend != AUTO  # readers never see "auto"
    assert ParallelSpec(device=device).attention_backend == want
    assert resolve_attention_backend(AUTO, device) == want


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_a_named_backend_is_kept(device, name):
    assert ParallelSpec(device=device, attention_backend=name).attention_backend == name


def test_configs_resolve_per_side(graph_of):
    graph = graph_of("prefill.device=cuda", "prefill.device_memory_gib=80")
    assert parallel_of(graph.spec, PRODUCER).attention_backend == "triton"
    assert parallel_of(graph.spec, CONSUMER).attention_backend == "torch"  # cpu
    pinned = graph_of("prefill.device=cuda", "prefill.attention_backend=torch")
    assert parallel_of(pinned.spec, PRODUCER).attention_backend == "torch"


def test_the_default_names_a_registered_backend():
    from pdflow.attention.backends import get_backend

    assert get_backend(ParallelSpec().attention_backend).name == "torch"


QWEN3_06B_ON_ONE_GPU = ("model=qwen3-0.6b", "prefill=tp1", "decode=tp1", "drafter=none",
                        "prefill.device_memory_gib=80", "decode.device_memory_gib=80")


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_eight_kv_heads_at_8192_tokens_plan_on_pdflows_backends(graph_of, backend):
    # 8192 x 8 KV heads = 65536 rows: over CUDA's y/z cap, but pdflow's kernels put rows
    # on grid axis 0, and the torch ops have no grid.
    graph = graph_of(*QWEN3_06B_ON_ONE_GPU, "prefill.device=cuda", "decode.device=cuda",
                     f"prefill.attention_backend={backend}", f"decode.attention_backend={backend}")
    assert graph.spec.prefill.max_num_batched_tokens == 8192 and graph.spec.model.kv_heads == 8
    assert graph.validate() == []


def test_a_backend_that_declares_a_grid_limit_is_refused_by_name(graph_of, monkeypatch):
    from pdflow.graph import Code
    from pdflow.spec import attention

    monkeypatch.setitem(attention.BACKEND_LIMITS, "capped_kernels",
                        attention.BackendLimits(grid_row_limit=65535))
    graph = graph_of(*QWEN3_06B_ON_ONE_GPU, "prefill.attention_backend=capped_kernels")
    assert graph.codes() == {Code.BATCH_OVER_GRID_LIMIT}
    (refusal,) = graph.validate()
    assert "'capped_kernels'" in refusal.message and "65536" in refusal.message
    assert refusal.message.startswith("prefill.max_num_batched_tokens=8192") and "at most 8191" in refusal.fix


def test_registering_a_backend_declares_its_limits(monkeypatch):
    from pdflow.attention import backends
    from pdflow.spec import attention

    monkeypatch.setattr(attention, "BACKEND_LIMITS", dict(attention.BACKEND_LIMITS))
    monkeypatch.setattr(backends, "_factories", dict(backends._factories))
    backends.register_backend("capped_plugin", object, attention.BackendLimits(grid_row_limit=100))
    assert attention.backend_limits("capped_plugin").grid_row_limit == 100
    assert attention.backend_limits("triton").grid_row_limit is None
