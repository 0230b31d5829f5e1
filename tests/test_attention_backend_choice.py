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
