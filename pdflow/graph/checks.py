"""Cross-group checks on the spec, run before placement (which assumes they pass)."""

from __future__ import annotations

from pdflow.graph.heads import default_taps, heads_divisible, rank_heads
from pdflow.graph.overlap import check_overlap
from pdflow.graph.placement import CONSUMER, PRODUCER, kv_dtype, layer_partition, parallel_of
from pdflow.graph.refusals import Code, Refusal
from pdflow.spec import ParallelSpec, RunSpec
from pdflow.spec.attention import backend_limits
from pdflow.spec.checkpoint import geometry_mismatches, hf_geometry, read_hf_config
from pdflow.spec.dtypes import ENGINE_KV_DTYPES, kv_scale_dtype


def resolved_taps(spec: RunSpec) -> list[int]:
    d = spec.drafter
    if d.kind != "dspark":
        return []
    return list(d.taps) if d.taps is not None else default_taps(spec.model.layers, d.num_taps)


def _sides(spec: RunSpec) -> list[tuple[str, ParallelSpec]]:
    """The instances a run starts: a monolithic run's prefill side is neither placed nor checked."""
    roles = (CONSUMER,) if spec.mode == "monolithic" else (PRODUCER, CONSUMER)
    return [(role, parallel_of(spec, role)) for role in roles]


def check_partitions(spec: RunSpec) -> list[Refusal]:
    out = []
    layers = spec.model.layers
    for role, par in _sides(spec):
        parts = layer_partition(layers, par)
        if len(parts) != par.pp or sum(parts) != layers or min(parts) < 1:
            out.append(
                Refusal(
                    code=Code.BAD_LAYER_PARTITION,
                    message=(
                        f"{role} layer partition {parts} over pp={par.pp} must have {par.pp} "
                        f"entries, each >= 1, summing to the model's {layers} layers."
                    ),
                    fix=(
                        f"set {role}.layer_partition to {par.pp} positive counts summing to "
                        f"{layers}, or drop it for an even split (pp <= {layers})."
                    ),
                )
            )
    return out


def check_head_cuts(spec: RunSpec) -> list[Refusal]:
    out = []
    groups = [("target", spec.model.kv_heads)]
    if spec.drafter.enabled:
        groups.append(("drafter", spec.drafter.kv_heads))
    for role, par in _sides(spec):
        for what, kv in groups:
            if not heads_divisible(kv, par.tp):
                out.append(
                    Refusal(
                        code=Code.HEAD_CUT_NOT_DIVISIBLE,
                        message=f"{role} tp={par.tp} cannot split the {what}'s {kv} KV heads "
                        "evenly nor replicate them (neither divides the other).",
                        fix=f"use a {role}.tp that divides {kv} or is a multiple of it.",
                    )
                )
    p, c = spec.prefill.tp, spec.decode.tp
    if spec.mode == "pd" and max(p, c) % min(p, c):
        out.append(
            Refusal(
                code=Code.HEAD_CUT_NOT_DIVISIBLE,
                message=f"producer tp={p} and consumer tp={c}: neither is a multiple of the "
                "other, so a consumer rank's heads would straddle producer ranks unevenly.",
                fix="pick tp degrees where one is a multiple of the other (e.g. 1->4, 2->4, 4->2).",
            )
        )
    return out


def _page_refusals(owner: str, what: str, page: int | None, role: str, block: int) -> list[Refusal]:
    if page is None:
        return [
            Refusal(
                code=Code.PAGE_UNDECLARED,
                message=f"the {what} KV binding declares no page ({owner} is null); a head "
                "cut needs the page to find each head's runs.",
                fix=f"set {owner} to the page size its attention binding reads and writes.",
            )
        ]
    if page < 1 or block % page:
        return [
            Refusal(
                code=Code.PAGE_NOT_DIVIDING_BLOCK,
                message=f"{owner}={page} does not divide {role}.block_size={block}.",
                fix=f"choose a page that divides {block} (e.g. 16 or {block}).",
            )
        ]
    return []


def check_pages(spec: RunSpec) -> list[Refusal]:
    out = []
    for role, par in _sides(spec):
        out += _page_refusals(f"{role}.kv_page_tokens", "target", par.kv_page_tokens, role, par.block_size)
    if spec.drafter.enabled:
        page = spec.drafter.page_tokens
        for role, par in _sides(spec):
            found = _page_refusals("drafter.page_tokens", "drafter", page, role, par.block_size)
            out += [r for r in found if r not in out]
    return out


# GPU transfers copy 8-byte words (kernels/copy_runs.py): a scale unit's run per head
# and page is page_tokens bytes, so its page must be a multiple of 8 tokens.
SCALE_RUN_WORD = 8


def check_kv_dtypes(spec: RunSpec) -> list[Refusal]:
    """A KV dtype the engine cannot store (the plan's sizes would be right, the run not)."""
    return [
        Refusal(code=Code.KV_DTYPE_UNSUPPORTED,
                message=f"{role}'s KV dtype {dt} has no cache the engine writes and reads.",
                fix=f"use one of {', '.join(sorted(ENGINE_KV_DTYPES))} (model.kv_dtype or {role}.kv_dtype).")
        for role, par in _sides(spec) if (dt := kv_dtype(spec.model, par)) not in ENGINE_KV_DTYPES
    ]


def check_scale_pages(spec: RunSpec) -> list[Refusal]:
    """A P/D run with GPU caches and a scaled KV dtype (fp8) whose page leaves the scale
    units' runs off the copy kernels' 8-byte words."""
    if spec.mode != "pd" or not any(par.device.startswith("cuda") for _, par in _sides(spec)):
        return []
    pages = {}
    for role, par in _sides(spec):
        if kv_scale_dtype(kv_dtype(spec.model, par)) is not None:
            pages[f"{role}.kv_page_tokens"] = par.kv_page_tokens
            if spec.drafter.enabled:
                pages["drafter.page_tokens"] = spec.drafter.page_tokens
    return [
        Refusal(code=Code.KV_SCALE_PAGE_UNALIGNED,
                message=f"{owner}={page} with an fp8 KV: each head's scales are {page} bytes per page, "
                        f"and GPU transfers copy {SCALE_RUN_WORD}-byte words.",
                fix=f"use a page that is a multiple of {SCALE_RUN_WORD} tokens (e.g. 16).")
        for owner, page in pages.items() if page is not None and page % SCALE_RUN_WORD
    ]


def check_drafter(spec: RunSpec) -> list[Refusal]:
    d, layers = spec.drafter, spec.model.layers
    out = []
    bad = [t for t in resolved_taps(spec) if not 0 <= t < layers]
    if bad:
        out.append(
            Refusal(
                code=Code.DRAFTER_TAP_OUT_OF_RANGE,
                message=f"drafter taps {bad} lie outside the target's layers 0..{layers - 1}.",
                fix=f"declare drafter.taps within 0..{layers - 1}.",
            )
        )
    pp = max(par.pp for _, par in _sides(spec))
    if d.enabled and d.taps_target_layers and not d.taps_declared and pp > 1:
        out.append(
            Refusal(
                code=Code.EAGLE3_UNDER_PP,
                message=f"the {d.kind} drafter taps target layers named by its checkpoint, not "
                f"declared in the config; under pp={pp} only declared taps ride the activations "
                "to the last stage, so the producer would write wrong draft context K/V.",
                fix="use a pp=1 prefill (e.g. prefill=tp4), or a drafter with declared taps "
                "(drafter=dspark).",
            )
        )
    return out


def check_grid(spec: RunSpec) -> list[Refusal]:
    """A batch the side's attention backend cannot launch: only backends that declare a
    grid row limit have one (pdflow's kernels put rows on grid axis 0, uncapped)."""
    out = []
    kvs = [spec.model.kv_heads] + ([spec.drafter.kv_heads] if spec.drafter.enabled else [])
    for role, par in _sides(spec):
        backend = par.attention_backend
        limit = backend_limits(backend).grid_row_limit
        if limit is None:
            continue
        per_rank = max(len(rank_heads(kv, par.tp, 0)) for kv in kvs)
        rows = par.max_num_batched_tokens * per_rank
        if rows > limit:
            out.append(
                Refusal(
                    code=Code.BATCH_OVER_GRID_LIMIT,
                    message=f"{role}.max_num_batched_tokens={par.max_num_batched_tokens} x "
                    f"{per_rank} KV heads per rank = {rows} attention rows, over the grid "
                    f"row limit of {limit} that attention backend {backend!r} declares.",
                    fix=f"lower {role}.max_num_batched_tokens to at most {limit // per_rank}, "
                    f"or use an attention backend without the limit ({role}.attention_backend="
                    "triton or torch).",
                )
            )
    return out


def check_model_geometry(spec: RunSpec) -> list[Refusal]:
    """A declared geometry that disagrees with the checkpoint at ``model.path``: the graph
    would place heads and size KV units for a model that is not there. A path this
    machine cannot read is not checked (plans may be made away from the checkpoint)."""
    model = spec.model
    if not model.path:
        return []
    try:
        geometry = hf_geometry(read_hf_config(model.path, model.revision))
    except (OSError, ValueError, KeyError):
        return []
    return [
        Refusal(
            code=Code.MODEL_GEOMETRY_MISMATCH,
            message=f"model.{key}={declared!r} but the checkpoint at {model.path} has "
            f"{key} {found!r} (its config.json).",
            fix=f"set model.{key}={found}, or take the whole geometry from the checkpoint: "
            f"model=hf model.path={model.path}.",
        )
        for key, declared, found in geometry_mismatches(model, geometry)
    ]


def check_expert_split(spec: RunSpec) -> list[Refusal]:
    """TP cuts every expert's intermediate dimension (no expert parallelism): a width that
    does not split evenly would fail only when a rank builds its layers."""
    width = spec.model.moe_intermediate
    if not spec.model.experts:
        return []
    return [
        Refusal(
            code=Code.EXPERT_SPLIT_NOT_DIVISIBLE,
            message=f"{role} tp={par.tp} cannot split each expert's intermediate width "
            f"{width} evenly (model.moe_intermediate).",
            fix=f"use a {role}.tp that divides {width}.",
        )
        for role, par in _sides(spec) if width % par.tp
    ]


def check_spec(spec: RunSpec) -> list[Refusal]:
    return [
        *check_model_geometry(spec),
        *check_expert_split(spec),
        *check_partitions(spec),
        *check_head_cuts(spec),
        *check_pages(spec),
        *check_kv_dtypes(spec),
        *check_scale_pages(spec),
        *check_drafter(spec),
        *check_grid(spec),
        *check_overlap(spec),
    ]
