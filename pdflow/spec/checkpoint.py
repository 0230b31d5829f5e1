"""A checkpoint's geometry, read from its HF ``config.json`` (plain JSON, no torch).

One reading serves three places: conf/model/hf.yaml takes its fields from here (the
``pdflow.checkpoint`` resolver), the graph refuses a declared geometry that disagrees
with it, and the model loader builds its DecoderConfig from the same fields.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from pdflow.spec.dtypes import ALIASES
from pdflow.spec.hub import hub_name, hub_snapshot, is_hub_id

PACKAGE_PREFIX = "pdflow:"

ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# ModelSpec fields that must equal the checkpoint's: the graph places heads and sizes
# KV units from them, so a wrong one serves a model that is not there.
GEOMETRY_KEYS = ("architecture", "layers", "hidden", "heads", "kv_heads", "head_dim",
                 "intermediate", "vocab", "experts", "experts_per_token", "moe_intermediate",
                 "mlp_only_layers", "sparse_step")
# Further fields a ``model=hf`` config takes from the checkpoint; a declared value may
# differ on purpose (compute in bf16, serve a shorter context), so they are not checked.
DEFAULTED_KEYS = ("dtype", "max_model_len")


def resolve_model_path(path: str | Path, revision: str | None = None, *, weights: bool = True,
                       hub: bool = True) -> Path:
    """``pdflow:assets/tiny`` -> that folder of the installed pdflow package; a hub id
    (``Qwen/Qwen3-0.6B``, no such local folder) -> its snapshot in the Hugging Face cache at
    ``revision`` (``weights=False``: config.json only; ``hub=False``: never asked); any
    other value is a filesystem path. Raises FileNotFoundError when the folder is missing."""
    text = str(path)
    if hub and is_hub_id(text):
        return hub_snapshot(text, revision, weights=weights)
    if text.startswith(PACKAGE_PREFIX):
        inner = text[len(PACKAGE_PREFIX) :].strip("/")
        resolved = Path(str(resources.files("pdflow").joinpath(inner)))
    else:
        resolved = Path(text).expanduser()
    if not resolved.is_dir():
        raise FileNotFoundError(f"model folder {resolved} (from {text!r}) does not exist")
    return resolved


def model_name(path: str | Path) -> str:
    """A checkpoint's name: its folder's, or a hub id's repository name."""
    text = str(path)
    return hub_name(text) if is_hub_id(text) else resolve_model_path(text, hub=False).name


def read_hf_config(path: str | Path, revision: str | None = None) -> dict[str, Any]:
    """The checkpoint's config.json as a dict (FileNotFoundError names the file)."""
    file = resolve_model_path(path, revision, weights=False) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: a HF checkpoint folder holds one")
    return json.loads(file.read_text())


def hf_architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or [ARCH_BY_MODEL_TYPE.get(raw.get("model_type"), "")]
    return archs[0]


def hf_geometry(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec fields (GEOMETRY_KEYS and DEFAULTED_KEYS) of a HF config dict. A config
    without a dtype is float32 (HF's default); ModelSpec refuses a dtype it cannot use."""
    heads = raw["num_attention_heads"]
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return {
        "architecture": hf_architecture(raw),
        "layers": raw["num_hidden_layers"],
        "hidden": raw["hidden_size"],
        "heads": heads,
        "kv_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "intermediate": raw["intermediate_size"],
        "vocab": raw["vocab_size"],
        **moe_geometry(raw),
        "dtype": ALIASES.get(dtype, dtype),
        "max_model_len": raw.get("max_position_embeddings", 4096),
    }


def moe_geometry(raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a HF config (Qwen3-MoE names; transformers 5 writes
    ``num_local_experts`` where released checkpoints say ``num_experts``); zeros: dense."""
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if not experts:
        return {"experts": 0, "experts_per_token": 0, "moe_intermediate": 0,
                "mlp_only_layers": None, "sparse_step": 1}
    return {
        "experts": experts,
        "experts_per_token": raw["num_experts_per_tok"],
        "moe_intermediate": raw["moe_intermediate_size"],
        "mlp_only_layers": sorted(raw.get("mlp_only_layers") or []) or None,
        "sparse_step": raw.get("decoder_sparse_step") or 1,
    }


def checkpoint_field(key: str, *, _parent_) -> Any:
    """OmegaConf resolver ``${pdflow.checkpoint:<key>}`` inside a model config: that field
    of the checkpoint at the config's ``path`` (``name``: the folder's name)."""
    path = None if _parent_._get_node("path")._is_missing() else _parent_.path
    revision = _parent_.get("revision")
    if not path and key == "mlp_only_layers":
        # A list field is resolved once when hf.yaml merges into the schema, before the
        # command line's path lands; the interpolation stays and resolves again later.
        # The other fields still refuse a missing path.
        return None
    if not path:
        raise ValueError(f"model.{key} comes from the checkpoint: give model.path=<HF checkpoint "
                         f"folder (with config.json) or hub id>, or set model.{key}")
    if key == "name":
        return model_name(path)
    return hf_geometry(read_hf_config(path, revision))[key]


def geometry_mismatches(model, geometry: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, declared, checkpoint) for every GEOMETRY_KEYS field of ``model`` (a
    ModelSpec) that disagrees with the checkpoint's ``geometry``."""
    return [(k, getattr(model, k), geometry[k]) for k in GEOMETRY_KEYS
            if _plain(getattr(model, k)) != _plain(geometry[k])]


def _plain(value: Any) -> Any:
    """A list field compared as a sorted list, empty as None (an OmegaConf ListConfig too)."""
    if value is None or isinstance(value, str | int | float):
        return value
    return sorted(value) or None
