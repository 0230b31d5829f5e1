"""fp8 KV through P/D on one GPU (both one-rank instances in the owner process): the
scale units ride every GPU mover, ``transfer=nccl`` (the ``ipc`` mover's packs and
scatters) and ``transfer=cuda_ipc`` (the ``peer`` mover's cache-to-cache runs), with the
Triton KV write quantizing and the Triton attention dequantizing. Greedy tokens equal a
monolithic fp8 instance's on the same GPU; with DSpark (its fp8 context K/V and scales in
the same pairs) drafts are accepted; shipping a neighbouring head's scales changes them."""

from __future__ import annotations

import pytest
import torch
from pd_gpu_kit import GPU_BASE, serve_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BASE = [*GPU_BASE, "decode.device_offset=0", "prefill=tp1", "decode=tp1", "model.kv_dtype=fp8_e4m3"]


@pytest.fixture(scope="module")
def monolithic():
    return serve_greedy([*BASE, "transfer=nccl", "mode=monolithic", "drafter=none"])[0]


@pytest.mark.parametrize("transfer", ["nccl", "cuda_ipc"])
def test_fp8_pd_on_one_gpu_equals_monolithic(monolithic, transfer):
    assert serve_greedy([*BASE, f"transfer={transfer}", "drafter=none"])[0] == monolithic


def test_fp8_pd_with_dspark_on_one_gpu_equals_monolithic_and_accepts(monolithic):
    tokens, accepted = serve_greedy([*BASE, "transfer=nccl", "drafter=dspark"])
    assert tokens == monolithic and accepted > 0


def test_fp8_wrong_scale_cut_on_one_gpu_changes_the_tokens(monolithic):
    """tp1 -> tp1 holds every head on both sides: the neighbouring head is another head of
    the same rank, so the wrong cut ships other scales through the GPU movers too."""
    wrong = serve_greedy([*BASE, "transfer=cuda_ipc", "drafter=none", "transfer.force_wrong_scale_cut=true"])[0]
    assert wrong != monolithic
