"""P/D on two GPUs over ``transfer=nccl`` and ``transfer=cuda_ipc``: the prefill PP2 and the
decode TP2 share GPUs 0-1 (nccl: each producer stage writes its own GPU's decode rank
through an IPC-mapped buffer and the other's over NCCL; cuda_ipc: its copy kernel writes
both ranks' mapped caches, over NVLink for the other GPU), and a TP1 -> TP1 pair across the
GPUs (NCCL alone); on four GPUs, PP4 -> TP4 co-located. Greedy tokens equal a monolithic
instance's, the DSpark drafter's context K/V riding the same pairs."""

from __future__ import annotations

import pytest
import torch
from pd_gpu_kit import GPU_BASE, GREEDY, prompts, serve_greedy

from pdflow import Deployment, compose

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

BASE = [*GPU_BASE, "drafter=dspark"]


def _run(overrides):
    return serve_greedy([*BASE, *overrides])


@pytest.fixture(scope="module")
def monolithic():
    return _run(["transfer=nccl", "mode=monolithic", "prefill=tp2", "decode=tp2", "decode.device_offset=0"])


ACROSS = pytest.param(["transfer=nccl", "prefill=tp1", "decode=tp1", "decode.device_offset=1"],
                      id="tp1->tp1 across GPUs (nccl)")


CO_LOCATED = ["prefill=pp2", "decode=tp2", "decode.device_offset=0"]


@pytest.mark.parametrize("layout", [
    pytest.param(["transfer=nccl", *CO_LOCATED], id="pp2->tp2 co-located (ipc+nccl)"),
    pytest.param(["transfer=cuda_ipc", *CO_LOCATED], id="pp2->tp2 co-located (cuda_ipc peer writes)"),
    ACROSS])
def test_pd_over_nccl_equals_monolithic(monolithic, layout):
    tokens, accepted = _run(layout)
    assert tokens == monolithic[0]
    assert accepted > 0


FOUR_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")


@FOUR_GPUS
def test_pp4_to_tp4_co_located_over_nccl_equals_monolithic_tp4():
    """The reference deployment's layout on four GPUs: each decode rank pairs with three
    producer stages over NCCL (and its own GPU's stage over IPC), many requests in flight.
    Before pairs connected their communicators at pairing, every transfer here timed out."""
    many = [p for p in prompts() for _ in range(4)]

    def run(overrides):
        with Deployment(compose([*BASE, *overrides, "decode.device_offset=0"])) as d:
            outs = d.generate(many, GREEDY)
            assert all(o.error is None for o in outs), [o.error for o in outs][:3]
            return [o.token_ids for o in outs], sum(o.num_accepted for o in outs)

    one, _ = run(["transfer=nccl", "mode=monolithic", "prefill=tp4", "decode=tp4"])
    pd, accepted = run(["transfer=nccl", "prefill=pp4", "decode=tp4"])
    assert pd == one
    assert accepted > 0
