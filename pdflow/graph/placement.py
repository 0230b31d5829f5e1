"""Placement: stages and their layers, ranks and their heads, the units each rank holds."""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.graph.heads import even_partition, lighter_last_partition, rank_heads
from pdflow.graph.units import DRAFT, INDEXER, TARGET, UnitSpec
from pdflow.spec import DrafterSpec, ModelSpec, ParallelSpec, RunSpec
from pdflow.spec.dtypes import canonical_dtype, kv_scale_dtype

PRODUCER, CONSUMER = "prefill", "decode"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    role: str
    rank: int  # rank within the instance: stage * tp + tp_rank
    stage: int
    # GPU index on the instance's host (see ``first_device``); unused on CPU.
    device_index: int
    tp_rank: int
    heads: tuple[int, ...]
    draft_heads: tuple[int, ...]
    units: tuple[UnitSpec, ...]

    @property
    def label(self) -> str:
        return f"{self.role}.s{self.stage}.t{self.tp_rank}"

    def unit(self, name: str) -> UnitSpec | None:
        return next((u for u in self.units if u.name == name), None)

    @property
    def target_units(self) -> tuple[UnitSpec, ...]:
        """The target model's K/V units: what this rank's engine binds to its layers."""
        return tuple(u for u in self.units if u.family == TARGET)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    index: int
    layer_start: int
    layer_stop: int
    ranks: tuple[RankPlan, ...]
    # Target layers whose hidden states this stage captures for the drafter.
    taps_captured: tuple[int, ...]
    # Taps this stage sends on to the next stage with its activations (captured so far).
    taps_relayed: tuple[int, ...]
    holds_drafter: bool

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)


@dataclass(frozen=True, kw_only=True, slots=True)
class InstancePlan:
    role: str
    tp: int
    pp: int
    stages: tuple[StagePlan, ...]

    @property
    def ranks(self) -> tuple[RankPlan, ...]:
        return tuple(r for s in self.stages for r in s.ranks)


def layer_partition(layers: int, par: ParallelSpec) -> list[int]:
    """The partition the spec asks for (explicit, or derived by its rule); unchecked."""
    if par.layer_partition is not None:
        return list(par.layer_partition)
    if par.partition == "lighter_last":
        return lighter_last_partition(layers, par.pp)
    return even_partition(layers, par.pp)


def kv_dtype(model: ModelSpec, par: ParallelSpec) -> str:
    return model.kv_dtype if par.kv_dtype == "auto" else canonical_dtype(par.kv_dtype)


def draft_dtype(model: ModelSpec, par: ParallelSpec, drafter: DrafterSpec) -> str:
    return kv_dtype(model, par) if drafter.dtype == "auto" else canonical_dtype(drafter.dtype)


def parallel_of(spec: RunSpec, role: str) -> ParallelSpec:
    """The parallel spec of ``role``'s instance: the prefill's for the producer, else the decode's."""
    return spec.prefill if role == PRODUCER else spec.decode


def first_device(spec: RunSpec, role: str) -> int:
    """GPU index of ``role``'s rank 0; its rank r sits on ``first_device + r``, one GPU each.

    An instance's ``device_offset`` wins when set. Otherwise the prefill starts at GPU 0
    and the decode right after the prefill's ranks, so a P/D pair on one host never
    shares a GPU: PP4 prefill -> TP4 decode puts the prefill stages on GPUs 0-3 and the
    decode ranks on 4-7, as the reference deployment does. A monolithic run starts no
    prefill instance, so its decode starts at GPU 0.
    """
    par = parallel_of(spec, role)
    if par.device_offset is not None:
        return par.device_offset
    if role == PRODUCER or spec.mode == "monolithic":
        return 0
    return spec.prefill.world_size


def _rank_units(
    *,
    model: ModelSpec,
    par: ParallelSpec,
    drafter: DrafterSpec,
    layers: range,
    heads: tuple[int, ...],
    draft_heads: tuple[int, ...],
) -> tuple[UnitSpec, ...]:
    # Per-family geometry; DRAFT only when this rank holds the drafter, so a bad
    # drafter.dtype with the drafter off is never resolved.
    geo = {
        TARGET: dict(
            heads=heads, head_dim=model.head_dim, dtype=kv_dtype(model, par), page_tokens=par.kv_page_tokens
        ),
        INDEXER: dict(
            heads=(),
            head_dim=model.indexer_key_dim,
            dtype=model.indexer_dtype,
            page_tokens=par.kv_page_tokens,
        ),
    }
    if draft_heads:
        geo[DRAFT] = dict(
            heads=draft_heads,
            head_dim=drafter.head_dim,
            dtype=draft_dtype(model, par, drafter),
            page_tokens=drafter.page_tokens,
        )

    def unit(family: str, fld: str, layer: int) -> UnitSpec:
        return UnitSpec(family=family, field=fld, layer=layer, block_size=par.block_size, **geo[family])

    def scale(family: str, fld: str, layer: int) -> UnitSpec:
        """A quantized field's scales: one per (token, head), cut and shipped like its KV."""
        g = geo[family]
        return UnitSpec(family=family, field=f"{fld}_scale", layer=layer, block_size=par.block_size,
                        heads=g["heads"], head_dim=1, dtype=kv_scale_dtype(g["dtype"]),
                        page_tokens=g["page_tokens"])

    def kv(family: str, layer: int) -> list[UnitSpec]:
        out = [unit(family, fld, layer) for fld in ("k", "v")]
        if kv_scale_dtype(geo[family]["dtype"]) is not None:
            out += [scale(family, fld, layer) for fld in ("k", "v")]
        return out

    units: list[UnitSpec] = []
    indexed = set(model.indexer_layers or ())
    for layer in layers:
        units += kv(TARGET, layer)
        if layer in indexed:
            units.append(unit(INDEXER, "key", layer))
    for row in range(drafter.layers if draft_heads else 0):
        units += kv(DRAFT, row)
    return tuple(units)


def place_instance(
    role: str,
    model: ModelSpec,
    par: ParallelSpec,
    drafter: DrafterSpec,
    taps: list[int],
    *,
    device_base: int,
) -> InstancePlan:
    """Stages, ranks, heads, units and GPUs of one instance. Assumes the checks passed.

    Rank r (``stage * tp + tp_rank``) is placed on GPU ``device_base + r``.

    The drafter lives with the last stage (producer) or on every rank (consumer); in both
    cases its KV heads are split over that stage's TP ranks like the target's.
    """
    parts = layer_partition(model.layers, par)
    stages: list[StagePlan] = []
    start = 0
    for s, count in enumerate(parts):
        stop = start + count
        last = s == len(parts) - 1
        holds_drafter = drafter.enabled and last
        ranks = []
        for t in range(par.tp):
            heads = rank_heads(model.kv_heads, par.tp, t)
            d_heads = rank_heads(drafter.kv_heads, par.tp, t) if holds_drafter else ()
            units = _rank_units(
                model=model,
                par=par,
                drafter=drafter,
                layers=range(start, stop),
                heads=heads,
                draft_heads=d_heads,
            )
            rank = s * par.tp + t
            ranks.append(
                RankPlan(
                    role=role,
                    rank=rank,
                    stage=s,
                    device_index=device_base + rank,
                    tp_rank=t,
                    heads=heads,
                    draft_heads=d_heads,
                    units=units,
                )
            )
        captured = tuple(t for t in taps if start <= t < stop)
        relayed = () if last else tuple(t for t in taps if t < stop)
        stages.append(
            StagePlan(
                index=s,
                layer_start=start,
                layer_stop=stop,
                ranks=tuple(ranks),
                taps_captured=captured,
                taps_relayed=relayed,
                holds_drafter=holds_drafter,
            )
        )
        start = stop
    return InstancePlan(role=role, tp=par.tp, pp=par.pp, stages=tuple(stages))
