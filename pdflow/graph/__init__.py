"""The run graph: placement, KV units, region maps, head cuts, block budgets, refusals.

Pure Python (no torch, no sockets): ``pdflow plan`` runs it anywhere.
"""

from pdflow.graph.cut import CutPlan, CutRun, plan_runs
from pdflow.graph.overlap import overlap_scheduling
from pdflow.graph.placement import CONSUMER, PRODUCER, InstancePlan, RankPlan, StagePlan, parallel_of
from pdflow.graph.refusals import Code, GraphRefused, Refusal
from pdflow.graph.run_graph import RunGraph, build_graph
from pdflow.graph.units import Run, UnitSpec

__all__ = [
    "CONSUMER",
    "PRODUCER",
    "Code",
    "CutPlan",
    "CutRun",
    "GraphRefused",
    "InstancePlan",
    "RankPlan",
    "Refusal",
    "Run",
    "RunGraph",
    "StagePlan",
    "UnitSpec",
    "build_graph",
    "overlap_scheduling",
    "parallel_of",
    "plan_runs",
]
