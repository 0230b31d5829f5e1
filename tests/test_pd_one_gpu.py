"""P/D on one GPU, both one-rank instances run by the owner process: over ``transfer=nccl``
(the ``ipc`` mover: the consumer's receive buffer handed over in-process, since CUDA IPC
cannot open its own process's memory) and ``transfer=cuda_ipc`` (the ``peer`` mover: its
caches handed over the same way). The prefill runs overlap scheduling (auto: a one-rank
CUDA side without a drafter), so each export is issued from its launched step with no
synchronize before it: the copies must still read the KV the forward wrote. Greedy tokens
equal a monolithic instance's on the same GPU, every block back; with the DSpark drafter
too (its context K/V in the same pairs), drafts accepted."""

from __future__ import annotations

import pytest
import torch
from pd_gpu_kit import GPU_BASE, serve_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BASE = [*GPU_BASE, "decode.device_offset=0", "prefill=tp1", "decode=tp1"]


def _overlapped(d) -> None:
    assert d.producer.executor.overlap


def _run(overrides, *, pd: bool):
    check = _overlapped if pd and "drafter=dspark" not in overrides else None
    return serve_greedy([*BASE, *overrides], check)


@pytest.fixture(scope="module")
def monolithic():
    return _run(["transfer=nccl", "mode=monolithic", "drafter=none"], pd=False)[0]


@pytest.mark.parametrize("transfer", ["nccl", "cuda_ipc"])
def test_pd_on_one_gpu_in_one_process_equals_monolithic(monolithic, transfer):
    assert _run([f"transfer={transfer}", "drafter=none"], pd=True)[0] == monolithic


def test_pd_with_dspark_on_one_gpu_equals_monolithic_with_it():
    """The drafter's context K/V rides the same in-process pair (the last stage reads its
    drafts back before it exports: no overlap there)."""
    dspark = ["drafter=dspark", "transfer=nccl"]
    tokens, accepted = _run(dspark, pd=True)
    assert tokens == _run([*dspark, "mode=monolithic"], pd=False)[0]
    assert accepted > 0
