"""Head-cut plans: for one block, the byte runs each producer rank writes to each
consumer rank (see docs/ARCHITECTURE.md, 'KV units, pages and the head cut')."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from pdflow.graph.placement import InstancePlan, RankPlan
from pdflow.graph.regions import Region, unit_catalog
from pdflow.graph.units import UnitSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class CutRun:
    """Copy ``length`` bytes from ``src`` in the producer's block to ``dst`` in the
    consumer's block."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CutGroup:
    """Units that share one run list (same geometry and head slice)."""

    units: tuple[tuple[str, str], ...]  # (producer unit, consumer unit)
    runs: tuple[CutRun, ...]

    @property
    def bytes_per_unit(self) -> int:
        """Bytes one unit pair moves per block (its runs, packed back to back)."""
        return sum(r.length for r in self.runs)


@dataclass(frozen=True, kw_only=True, slots=True)
class CutPlan:
    producer_rank: int
    consumer_rank: int
    groups: tuple[CutGroup, ...]

    @property
    def descriptors_per_block(self) -> int:
        return sum(len(g.units) * len(g.runs) for g in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return sum(len(g.units) * g.bytes_per_unit for g in self.groups)

    def over(self, sources: set[str]) -> CutPlan:
        """The part of this plan over the source units a producer rank has caches for (a
        drafter's units join when its stage binds them)."""
        groups = []
        for group in self.groups:
            units = tuple((s, d) for s, d in group.units if s in sources)
            if units:
                groups.append(dataclasses.replace(group, units=units))
        return dataclasses.replace(self, groups=tuple(groups))


def plan_runs(src: UnitSpec, dst: UnitSpec, heads: tuple[int, ...],
              src_heads: tuple[int, ...] | None = None) -> tuple[CutRun, ...]:
    """Runs moving ``heads`` (contiguous, held by both) of one block from ``src`` to ``dst``.

    For every page p the slice sits at ``((p*H_src) + a) * span`` in the producer and lands
    at ``((p*H_dst) + a') * span`` in the consumer; runs contiguous on both sides merge.
    A headless unit (no heads) moves as one run of its whole block. ``src_heads`` (a
    deliberate fault only): read these producer heads instead.
    """
    src_runs = src.head_major_runs(heads if src_heads is None else src_heads)
    dst_runs = dst.head_major_runs(heads)
    merged: list[CutRun] = []
    for s, d in zip(src_runs, dst_runs, strict=True):
        prev = merged[-1] if merged else None
        if prev and prev.src + prev.length == s.offset and prev.dst + prev.length == d.offset:
            merged[-1] = CutRun(src=prev.src, dst=prev.dst, length=prev.length + s.length)
        else:
            merged.append(CutRun(src=s.offset, dst=d.offset, length=s.length))
    return tuple(merged)


def _sources(holders: list[tuple[RankPlan, UnitSpec]], dst: UnitSpec):
    """Split the consumer unit's heads by the producer rank that sends each one: the first
    (lowest tp_rank) holder of a head, so replicated heads are sent once."""
    if not dst.heads:
        rank, unit = min(holders, key=lambda h: h[0].tp_rank)
        yield rank, unit, ()
        return
    chunk: list[int] = []
    owner = None
    for head in dst.heads:
        holder = min((h for h in holders if head in h[1].heads), key=lambda h: h[0].tp_rank)
        if owner is not None and holder[0] is not owner[0]:
            yield owner[0], owner[1], tuple(chunk)
            chunk = []
        owner = holder
        chunk.append(head)
    yield owner[0], owner[1], tuple(chunk)


def page_ignorant(unit: UnitSpec) -> UnitSpec:
    """The unit as a cut that forgets its page sees it: one page per block. Cutting with
    this on a paged unit hands each consumer rank another head's bytes, silently."""
    return dataclasses.replace(unit, page_tokens=unit.block_size)


def neighbour_runs(src: UnitSpec, dst: UnitSpec, heads: tuple[int, ...]) -> tuple[CutRun, ...]:
    """A deliberately wrong cut: each of ``heads`` lands with the bytes of the next head
    ``src`` holds (cyclically); the right cut when ``src`` holds one head only."""
    held = src.heads
    return tuple(run for h in heads
                 for run in plan_runs(src, dst, (h,), (held[(held.index(h) + 1) % len(held)],)))


def build_cut_plans(
    producer: InstancePlan, consumer: InstancePlan, regions: list[Region],
    page_ignorant_families: frozenset[str] = frozenset(), wrong_scale_cut: bool = False,
) -> list[CutPlan]:
    """``page_ignorant_families``: unit families cut as if their page were the block;
    ``wrong_scale_cut``: scale units cut from a neighbouring head (deliberate faults, to
    show tests and runs catch them); both off in every real deployment."""
    holders = unit_catalog(producer)
    src_of = {r.consumer_unit: r.producer_unit for r in regions}
    groups: dict[tuple[int, int], dict[tuple[CutRun, ...], list[tuple[str, str]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for crank in consumer.ranks:
        for dst in crank.units:
            src_name = src_of.get(dst.name)
            if src_name is None:
                continue
            for prank, src, heads in _sources(holders[src_name], dst):
                if dst.family in page_ignorant_families:
                    runs = plan_runs(page_ignorant(src), page_ignorant(dst), heads)
                elif wrong_scale_cut and dst.field.endswith("_scale") and heads:
                    runs = neighbour_runs(src, dst, heads)
                else:
                    runs = plan_runs(src, dst, heads)
                groups[(prank.rank, crank.rank)][runs].append((src_name, dst.name))
    return [
        CutPlan(
            producer_rank=p,
            consumer_rank=c,
            groups=tuple(CutGroup(units=tuple(u), runs=runs) for runs, u in by_runs.items()),
        )
        for (p, c), by_runs in sorted(groups.items())
    ]
