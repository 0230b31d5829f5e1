"""The run graph: one composed spec turned into placement, units, regions, cuts and
budgets, with every refusal. The only place that computes these; everything asks it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdflow.graph.budget import BlockBudget, block_budget
from pdflow.graph.checks import check_spec, resolved_taps
from pdflow.graph.cut import CutPlan, build_cut_plans
from pdflow.graph.devices import DeviceFacts
from pdflow.graph.memory import memory_refusals, rank_usable, sharers
from pdflow.graph.placement import (
    CONSUMER,
    PRODUCER,
    InstancePlan,
    RankPlan,
    first_device,
    parallel_of,
    place_instance,
)
from pdflow.graph.refusals import STRUCTURAL, Code, GraphRefused, Refusal
from pdflow.graph.regions import Region, build_regions
from pdflow.graph.transfer_buffers import rank_transfer_bytes, transfer_label
from pdflow.spec import RunSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterPlan:
    kind: str
    taps: tuple[int, ...]
    # Stage of the producer that captures each tap.
    tap_stage: dict[int, int]
    drafter_stage: int
    # Producers write the draft context K/V; they propose only when writing it needs a
    # propose step (eagle), never to emit drafts.
    producer_proposes: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class RunGraph:
    spec: RunSpec
    producer: InstancePlan | None
    consumer: InstancePlan | None
    drafter: DrafterPlan | None
    regions: tuple[Region, ...]
    cuts: tuple[CutPlan, ...]
    budgets: dict[str, BlockBudget]
    refusals: tuple[Refusal, ...]
    # The KV transfer the run uses (transfer=auto resolved), as ``transfer_label`` names it.
    transfer: str = ""
    # The GPU memory facts the budgets were sized with (None: the described hardware);
    # the owner hands them to every rank so each builds this same graph.
    devices: DeviceFacts | None = None

    def validate(self) -> list[Refusal]:
        """Every refusal at once (empty when the deployment is allowed)."""
        return list(self.refusals)

    def raise_if_refused(self) -> RunGraph:
        if self.refusals:
            raise GraphRefused(self.refusals)
        return self

    def codes(self) -> set[Code]:
        return {r.code for r in self.refusals}

    def instance(self, role: str) -> InstancePlan:
        plan = self.producer if role == PRODUCER else self.consumer
        if plan is None and not self.refusals:
            raise ValueError(f"the run graph places no {role} instance (mode=monolithic plans the decode "
                             "side only): use mode=pd for a prefill instance")
        if plan is None:
            raise GraphRefused(self.refusals)
        return plan

    def rank(self, role: str, rank: int) -> RankPlan:
        return self.instance(role).ranks[rank]

    def cut(self, producer_rank: int, consumer_rank: int) -> CutPlan | None:
        return next(
            (c for c in self.cuts if (c.producer_rank, c.consumer_rank) == (producer_rank, consumer_rank)),
            None,
        )

    @property
    def transfer_bytes_per_block(self) -> int:
        """Bytes one prompt block moves from producer to consumer: every cut plan's runs
        (KV, scale units and drafter units together); 0 without a producer."""
        return sum(c.bytes_per_block for c in self.cuts)

    @property
    def kv_pairs(self) -> int:
        """Producer -> consumer rank pairs that move a prompt's KV (each its own transfer)."""
        return len({(c.producer_rank, c.consumer_rank) for c in self.cuts})

    def consumer_ranks_of(self, producer_rank: int) -> list[int]:
        """The consumer ranks a producer rank's cut plans write into."""
        return sorted({c.consumer_rank for c in self.cuts if c.producer_rank == producer_rank})

    def to_dict(self) -> dict:
        """Plain data for ``pdflow plan --json`` and for logging."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "spec"}
        out["allowed"] = not self.refusals
        return out


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        data = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if hasattr(value, "name") and "name" not in data:
            data["name"] = value.name
        return data
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Code):
        return value.value
    return value


def build_graph(spec: RunSpec, devices: DeviceFacts | None = None) -> RunGraph:
    """``devices``: the GPUs' memory read at start (None: plan for the described
    hardware). A monolithic run places, checks and sizes its decode instance only."""
    refusals = check_spec(spec)
    label = transfer_label(spec)
    empty = dict(producer=None, consumer=None, drafter=None, regions=(), cuts=(), budgets={})
    if any(r.code in STRUCTURAL for r in refusals):
        return RunGraph(spec=spec, refusals=tuple(refusals), transfer=label, devices=devices, **empty)
    taps = [t for t in resolved_taps(spec) if 0 <= t < spec.model.layers]
    roles = (CONSUMER,) if spec.mode == "monolithic" else (PRODUCER, CONSUMER)
    plans = {
        role: place_instance(role, spec.model, parallel_of(spec, role), spec.drafter, taps,
                             device_base=first_device(spec, role))
        for role in roles
    }
    producer, consumer = plans.get(PRODUCER), plans[CONSUMER]
    drafter = None
    if spec.drafter.enabled:
        writer = producer or consumer  # the instance whose prefill captures the taps
        drafter = DrafterPlan(
            kind=spec.drafter.kind,
            taps=tuple(taps),
            tap_stage={t: s.index for s in writer.stages for t in s.taps_captured},
            drafter_stage=writer.stages[-1].index,
            producer_proposes=not spec.drafter.context_kv_only,
        )
    regions, cuts = [], []
    if producer is not None:
        regions, region_refusals = build_regions(producer, consumer, spec.transfer.consumer_map)
        refusals += region_refusals
        wrong = frozenset(spec.transfer.force_page_ignorant_cut)
        cuts = [] if region_refusals else build_cut_plans(producer, consumer, regions, wrong,
                                                          spec.transfer.force_wrong_scale_cut)
    shared = sharers(list(plans.values()), spec)
    budgets, usable = {}, {}
    for role, plan in plans.items():
        usable[role], sizing = rank_usable(spec, plan, shared, devices)
        budget = block_budget(role, plan, spec.model, parallel_of(spec, role), spec.drafter, len(taps),
                              rank_transfer_bytes(spec, cuts, role), usable[role], sizing)
        budgets[role] = budget
        if budget.pool_blocks < 1:
            worst = budget.stages[budget.binding_stage]
            refusals.append(
                Refusal(
                    code=Code.KV_POOL_EMPTY,
                    message=f"{role} stage {worst.stage} has no room for a KV block: "
                    f"{worst.usable_bytes} usable bytes ({sizing}), {worst.weight_bytes} of weights, "
                    f"{worst.activation_bytes} of activations, {worst.transfer_bytes} of transfer buffers, "
                    f"{worst.bytes_per_block} per block.",
                    fix=f"raise {role}.memory (a fraction of the device) or {role}.device_memory_gib, add "
                    f"pp/tp, or lower {role}.max_num_batched_tokens.",
                )
            )
    refusals += memory_refusals(spec, plans, usable, devices)
    return RunGraph(
        spec=spec,
        producer=producer,
        consumer=consumer,
        drafter=drafter,
        regions=tuple(regions),
        cuts=tuple(cuts),
        budgets=budgets,
        refusals=tuple(refusals),
        transfer=label,
        devices=devices,
    )
