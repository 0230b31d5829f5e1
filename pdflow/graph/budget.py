"""KV block budget: bytes per block on every stage, and how many blocks each can hold.

All ranks of an instance allocate the same number of blocks (a block id means the same
tokens on every stage), so the pool is the minimum over stages: the stage with the
most bytes per block, or the least memory left after weights, binds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.graph.placement import InstancePlan, StagePlan
from pdflow.spec import DrafterSpec, ModelSpec, ParallelSpec
from pdflow.spec.dtypes import dtype_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StageBudget:
    stage: int
    bytes_per_block: int
    weight_bytes: int
    activation_bytes: int
    # The KV transfer pairs' buffers on this stage's busiest rank (``transfer_buffers``).
    transfer_bytes: int
    usable_bytes: int
    blocks: int


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockBudget:
    role: str
    stages: tuple[StageBudget, ...]
    pool_blocks: int
    binding_stage: int
    # True when the spec fixed the pool (num_kv_blocks) instead of memory deciding it.
    fixed: bool
    # How the usable bytes were sized (graph/memory.py), for ``pdflow plan``.
    sizing: str = ""
    # Tokens per block, so the pool reads in tokens too.
    block_size: int = 0

    @property
    def pool_tokens(self) -> int:
        return self.pool_blocks * self.block_size


def _drafter_params(model: ModelSpec, drafter: DrafterSpec, num_taps: int) -> int:
    """Drafter parameters; called only for the stage that holds the (enabled) drafter."""
    if drafter.param_count is not None:
        return drafter.param_count
    fc = max(num_taps, 2) * model.hidden * model.hidden
    return drafter.layers * model.dense_params_per_layer() + fc


def _stage_weights(
    model: ModelSpec, par: ParallelSpec, drafter: DrafterSpec, stage: StagePlan, num_taps: int
) -> int:
    # Every expert of a sparse layer is held by every TP rank, a 1/tp slice of each.
    params = sum(model.layer_params(layer) for layer in stage.layers)
    embed = model.vocab * model.hidden
    if stage.index == 0:
        params += embed
    if stage.index == par.pp - 1:
        params += embed  # LM head (counted even when tied: the estimate stays conservative)
    if stage.holds_drafter:
        params += _drafter_params(model, drafter, num_taps)
    return params * dtype_bytes(model.stored_weight_dtype) // par.tp


def _activation_bytes(model: ModelSpec, par: ParallelSpec, last: bool) -> int:
    """Peak scratch of one forward: residual stream, attention and MLP intermediates for
    max_num_batched_tokens, plus fp32 logits of the sampled rows on the last stage."""
    mlp = 3 * model.intermediate
    if model.experts:  # each token's routed copies: gate/up, activation, down per pick
        mlp = max(mlp, 3 * model.experts_per_token * model.moe_intermediate + model.experts)
    width = 4 * model.hidden + (mlp + 3 * model.heads * model.head_dim) // par.tp
    act = par.max_num_batched_tokens * width * dtype_bytes(model.dtype)
    logits = par.max_num_seqs * model.vocab * 4 if last else 0
    return act + logits


def block_budget(
    role: str,
    instance: InstancePlan,
    model: ModelSpec,
    par: ParallelSpec,
    drafter: DrafterSpec,
    num_taps: int,
    transfer_bytes: dict[int, int],
    usable: dict[int, int],
    sizing: str,
) -> BlockBudget:
    """``transfer_bytes``: rank -> bytes its KV transfer pairs hold (absent: none);
    ``usable``: rank -> bytes it may use in all and ``sizing`` how (``graph/memory.py``)."""
    stages = []
    for stage in instance.stages:
        per_block = sum(u.bytes_per_block for u in stage.ranks[0].units)
        weights = _stage_weights(model, par, drafter, stage, num_taps)
        act = _activation_bytes(model, par, stage.index == par.pp - 1)
        transfer = max(transfer_bytes.get(r.rank, 0) for r in stage.ranks)
        room = min(usable[r.rank] for r in stage.ranks)
        blocks = max(0, (room - weights - act - transfer) // per_block) if per_block else 0
        stages.append(
            StageBudget(
                stage=stage.index,
                bytes_per_block=per_block,
                weight_bytes=weights,
                activation_bytes=act,
                transfer_bytes=transfer,
                usable_bytes=room,
                blocks=blocks,
            )
        )
    binding = min(stages, key=lambda s: s.blocks)
    fixed = par.num_kv_blocks is not None
    pool = par.num_kv_blocks if fixed else binding.blocks
    return BlockBudget(
        role=role, stages=tuple(stages), pool_blocks=pool, binding_stage=binding.stage, fixed=fixed,
        sizing=sizing, block_size=par.block_size,
    )
