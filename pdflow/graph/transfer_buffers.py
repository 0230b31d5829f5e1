"""Memory a P/D run's KV transfer pairs hold on each rank, beside the KV pool.

With two-sided pairs (``transfer=nccl``, or Mooncake with ``transfer.staging``) a consumer
rank keeps a receive buffer per producer rank it pairs with and a producer rank a send
buffer per consumer rank: device memory when the caches are on a GPU. Each is
``transfer.staging_mib``, or less when the longest request packs into less. The block
budget subtracts them, so a pool sized to the device leaves them room; the listener sizes
its buffers with the same rule. Direct writes (Mooncake without staging, and
``transfer.peer_writes`` between GPUs) hold none.
"""

from __future__ import annotations

from pdflow.graph.cut import CutPlan
from pdflow.graph.placement import CONSUMER, PRODUCER, parallel_of
from pdflow.spec import RunSpec


def transfer_label(spec: RunSpec) -> str:
    """The transfer a run uses, as the config that names it (``cuda_ipc``, ``nccl``,
    ``mooncake_tcp``, ``mooncake_rdma``, ``+ direct`` without staging), with what
    transfer=auto chose it for; what ``pdflow plan`` shows."""
    t = spec.transfer
    if t.backend == "nccl":
        name = "cuda_ipc" if t.peer_writes else "nccl"
    else:
        name = f"mooncake_{t.protocol}" + ("" if t.staging else " direct")
    return f"{name} ({t.chosen})" if t.chosen else name


def pairs_hold_buffers(spec: RunSpec) -> bool:
    t = spec.transfer
    if spec.mode != "pd" or not (t.backend == "nccl" or t.staging):
        return False
    on_gpus = all(parallel_of(spec, role).device.startswith("cuda") for role in (PRODUCER, CONSUMER))
    return not (t.backend == "nccl" and t.peer_writes and on_gpus)


def pair_buffer_bytes(spec: RunSpec, plan: CutPlan, tokens: int | None = None) -> int:
    """One pair's buffer: the staging size, capped at a ``tokens``-long request (default
    the model's max_model_len) under the pair's plan, and at least two blocks' runs (one
    chunk per half of the buffer)."""
    block = parallel_of(spec, CONSUMER).block_size
    tokens = spec.model.max_model_len if tokens is None else tokens
    longest = plan.bytes_per_block * -(-tokens // block)
    return min(spec.transfer.staging_mib << 20, max(longest, 2 * plan.bytes_per_block))


def rank_transfer_bytes(spec: RunSpec, cuts: list[CutPlan] | tuple[CutPlan, ...], role: str) -> dict[int, int]:
    """Rank of ``role`` -> bytes of the pair buffers it holds."""
    out: dict[int, int] = {}
    if not pairs_hold_buffers(spec):
        return out
    for cut in cuts:
        rank = cut.producer_rank if role == PRODUCER else cut.consumer_rank
        out[rank] = out.get(rank, 0) + pair_buffer_bytes(spec, cut)
    return out
