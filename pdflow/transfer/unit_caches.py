"""Checking and registering a rank's unit caches (plain tensors by unit name)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from pdflow.graph.units import UnitSpec
from pdflow.transfer.descriptors import UnitRegion


def register_caches(transport, units: Iterable[UnitSpec], caches: Mapping[str, torch.Tensor],
                    names: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, UnitRegion]]:
    """Check the caches of units ``names`` (laid out as their ``UnitSpec``, one block
    count for all; ``register_unit`` checks shape and element size) and register each;
    returns them and their regions by unit name."""
    specs = {u.name: u for u in units}
    missing = sorted(n for n in names if n not in caches)
    if missing:
        raise ValueError(f"no cache given for units {missing}; pass one tensor per unit name")
    picked = {n: caches[n] for n in sorted(names)}
    counts = {c.shape[0] for c in picked.values()}
    if len(counts) > 1:
        raise ValueError(f"unit caches disagree on their block count: {sorted(counts)}")
    regions: dict[str, UnitRegion] = {}
    try:
        for name, cache in picked.items():
            regions[name] = transport.register_unit(specs[name], cache)
    except BaseException:
        for region in regions.values():
            transport.unregister(region.base)
        raise
    return picked, regions
