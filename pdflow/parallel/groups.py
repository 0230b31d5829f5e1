"""Process groups of one instance, derived from the graph's placement.

Ranks are numbered ``stage * tp + tp_rank`` (the graph's RankPlan.rank). Each stage's
ranks form a TP group; a rank's PP neighbours are the ranks of the adjacent stages with
the same tp_rank (hidden states and relayed taps go straight across).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.graph.placement import InstancePlan, RankPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTopology:
    prev_rank: int | None
    next_rank: int | None
    is_first_stage: bool
    is_last_stage: bool
    # The rank that samples and answers the owner: the last stage's first TP rank.
    is_driver: bool


def tp_group_ranks(plan: InstancePlan) -> list[tuple[int, ...]]:
    return [tuple(r.rank for r in stage.ranks) for stage in plan.stages]


def topology(plan: InstancePlan, me: RankPlan) -> RankTopology:
    stages = plan.stages
    s = me.stage
    prev_rank = stages[s - 1].ranks[me.tp_rank].rank if s > 0 else None
    next_rank = stages[s + 1].ranks[me.tp_rank].rank if s + 1 < len(stages) else None
    return RankTopology(
        prev_rank=prev_rank,
        next_rank=next_rank,
        is_first_stage=s == 0,
        is_last_stage=s == len(stages) - 1,
        is_driver=me.rank == driver_rank(plan),
    )


def driver_rank(plan: InstancePlan) -> int:
    return plan.stages[-1].ranks[0].rank
