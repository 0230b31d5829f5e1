"""The region map: which producer unit fills which consumer unit, found by name."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pdflow.graph.placement import InstancePlan, RankPlan
from pdflow.graph.refusals import Code, Refusal
from pdflow.graph.units import UnitSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    producer_unit: str
    consumer_unit: str


def unit_catalog(instance: InstancePlan) -> dict[str, list[tuple[RankPlan, UnitSpec]]]:
    """Every unit name of an instance with its holders: (rank, that rank's spec) pairs."""
    catalog: dict[str, list[tuple[RankPlan, UnitSpec]]] = defaultdict(list)
    for rank in instance.ranks:
        for unit in rank.units:
            catalog[unit.name].append((rank, unit))
    return dict(catalog)


def slot_key(name: str) -> str:
    """A unit's name without its geometry (``mha.k.layer_3``): what it is, not its shape."""
    family, _geometry, rest = name.split(".", 2)
    return f"{family}.{rest}"


def _all_heads(holders: list[tuple[RankPlan, UnitSpec]]) -> tuple[int, ...]:
    return tuple(sorted({h for _, u in holders for h in u.heads}))


def _mismatches(src: list[tuple[RankPlan, UnitSpec]], dst: list[tuple[RankPlan, UnitSpec]]) -> list[Refusal]:
    a, b = src[0][1], dst[0][1]
    return unit_mismatches(a, b, pair=f"producer unit {a.name} -> consumer unit {b.name}",
                           heads=(_all_heads(src), _all_heads(dst)))


def unit_mismatches(a: UnitSpec, b: UnitSpec, *, pair: str,
                    heads: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> list[Refusal]:
    """Refusals for two units that must agree (head_dim, dtype, page, block size and the
    KV heads, by default each unit's own): the region check here and pairing both ask it."""
    heads = heads or (a.heads, b.heads)
    checks = [
        (
            Code.UNIT_MISMATCH_HEAD_DIM,
            "head_dim",
            a.head_dim,
            b.head_dim,
            "map units of the same head_dim (check transfer.consumer_map and the drafter's head_dim).",
        ),
        (
            Code.UNIT_MISMATCH_DTYPE,
            "dtype",
            a.dtype,
            b.dtype,
            "give prefill.kv_dtype and decode.kv_dtype the same value (or both auto).",
        ),
        (
            Code.UNIT_MISMATCH_PAGE,
            "page_tokens",
            a.page_tokens,
            b.page_tokens,
            "declare the same page on both sides' bindings (prefill/decode.kv_page_tokens).",
        ),
        (
            Code.UNIT_MISMATCH_BLOCK,
            "block_size",
            a.block_size,
            b.block_size,
            "give prefill.block_size and decode.block_size the same value.",
        ),
        (
            Code.UNIT_MISMATCH_HEADS,
            "KV heads",
            heads[0],
            heads[1],
            "map units with the same KV heads (check transfer.consumer_map).",
        ),
    ]
    return [
        Refusal(code=code, message=f"{pair}: {what} {x} != {y}.", fix=fix)
        for code, what, x, y, fix in checks
        if x != y
    ]


def build_regions(
    producer: InstancePlan, consumer: InstancePlan, consumer_map: dict[str, str] | None
) -> tuple[list[Region], list[Refusal]]:
    """Map producer units onto consumer units (by name, or as ``consumer_map`` says; an
    empty target means "not sent") and refuse any region that is missing, doubly filled, unfilled or mismatched."""
    src_units, dst_units = unit_catalog(producer), unit_catalog(consumer)
    explicit = dict(consumer_map or {})
    refusals: list[Refusal] = []
    for src, dst in explicit.items():
        if src not in src_units:
            refusals.append(
                Refusal(
                    code=Code.REGION_MISSING,
                    message=f"transfer.consumer_map names producer unit {src}, which the "
                    "producer does not have.",
                    fix="use a unit name that `pdflow plan` lists for the producer.",
                )
            )
        if dst and dst not in dst_units:
            refusals.append(
                Refusal(
                    code=Code.REGION_MISSING,
                    message=f"transfer.consumer_map targets consumer unit {dst}, which the "
                    "consumer does not have.",
                    fix="use a unit name that `pdflow plan` lists for the consumer.",
                )
            )
    regions: list[Region] = []
    # By name; a name that differs only in geometry still pairs, so the mismatch is named.
    by_slot = {slot_key(name): name for name in dst_units}
    for src in src_units:
        dst = explicit.get(src, by_slot.get(slot_key(src), src))
        if not dst:
            continue  # mapped to "": deliberately not sent
        if dst not in dst_units:
            if src not in explicit:
                refusals.append(
                    Refusal(
                        code=Code.REGION_MISSING,
                        message=f"producer unit {src} has no consumer region of that name.",
                        fix="make both sides hold the same layers and drafter, or map it in "
                        "transfer.consumer_map.",
                    )
                )
            continue
        regions.append(Region(producer_unit=src, consumer_unit=dst))
    fillers: dict[str, list[str]] = defaultdict(list)
    for region in regions:
        fillers[region.consumer_unit].append(region.producer_unit)
    for dst, srcs in fillers.items():
        if len(srcs) > 1:
            refusals.append(
                Refusal(
                    code=Code.REGION_TWO_TO_ONE,
                    message=f"consumer unit {dst} would be written by {len(srcs)} producer "
                    f"units: {', '.join(sorted(srcs))}.",
                    fix="map exactly one producer unit to it in transfer.consumer_map.",
                )
            )
    for dst in dst_units:
        if dst not in fillers:
            refusals.append(
                Refusal(
                    code=Code.REGION_UNFILLED,
                    message=f"consumer unit {dst} is filled by no producer unit; decode would "
                    "read uninitialised KV.",
                    fix="map a producer unit to it in transfer.consumer_map (or remove the "
                    "entry that took its source elsewhere).",
                )
            )
    for region in regions:
        refusals += _mismatches(src_units[region.producer_unit], dst_units[region.consumer_unit])
    return regions, refusals
