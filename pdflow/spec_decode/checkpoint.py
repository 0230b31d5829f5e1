"""Drafter checkpoints: HF-style folders (config.json + model.safetensors) and builders.

Weights are saved with HF names (q/k/v and gate/up apart) so any TP degree can load
them through the sharded layers' ``weight_loader``s, as the target's loader does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdflow.graph.units import UnitSpec
from pdflow.model.config import DecoderConfig
from pdflow.model.loader import STACKED
from pdflow.model.paths import resolve_model_path
from pdflow.spec_decode.config import DrafterConfig
from pdflow.spec_decode.drafter import Drafter
from pdflow.spec_decode.dspark import DSparkDrafter
from pdflow.spec_decode.eagle import Eagle3Drafter, EagleDrafter, eagle3_default_taps

WEIGHTS = "model.safetensors"
CLASSES: dict[str, type[Drafter]] = {"dspark": DSparkDrafter, "eagle": EagleDrafter, "eagle3": Eagle3Drafter}


def drafter_config_for(graph, target: DecoderConfig, *, taps: Sequence[int] | None = None,
                       num_speculative_tokens: int | None = None) -> DrafterConfig:
    """A fresh drafter's geometry for this run (training, random-weight tests): the
    graph's drafter spec and taps (dspark), the target's hidden/vocab and GQA ratio.
    eagle3 takes ``taps`` (default low/mid/high), which then live in its checkpoint."""
    spec = graph.spec.drafter
    if spec.kind == "dspark":
        tap_layers = tuple(graph.drafter.taps)
    elif spec.kind == "eagle3":
        tap_layers = tuple(taps) if taps is not None else eagle3_default_taps(target.num_layers)
    else:
        tap_layers = ()
    return DrafterConfig(
        kind=spec.kind, hidden_size=target.hidden_size, num_layers=spec.layers,
        num_heads=spec.kv_heads * (target.num_heads // target.num_kv_heads),
        num_kv_heads=spec.kv_heads, head_dim=spec.head_dim, intermediate_size=target.intermediate_size,
        vocab_size=target.vocab_size, tap_layers=tap_layers,
        num_speculative_tokens=num_speculative_tokens or spec.num_speculative_tokens,
        target_num_layers=target.num_layers, rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings, qk_norm=target.qk_norm,
    )


def build_drafter(config: DrafterConfig, units: Sequence[UnitSpec], *, tp_rank: int = 0, tp_size: int = 1,
                  pp: int = 1, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> Drafter:
    """An uninitialised drafter for one rank (its draft units from the graph) of an
    instance with ``pp`` stages."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            drafter = CLASSES[config.kind](config, units, tp_rank=tp_rank, tp_size=tp_size)
    finally:
        torch.set_default_dtype(previous)
    drafter.check_runtime(pp=pp)
    return drafter


def _hf_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The state dict with stacked projections split back into HF names."""
    cfg, d = drafter.config, drafter.config.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {}
    for name, tensor in drafter.state_dict().items():
        t = tensor.detach().contiguous().cpu()
        if ".qkv_proj." in name:
            for part, piece in zip("qkv", t.split([q_rows, kv_rows, kv_rows]), strict=True):
                out[name.replace(".qkv_proj.", f".{part}_proj.")] = piece.clone()
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate.clone()
            out[name.replace(".gate_up_proj.", ".up_proj.")] = up.clone()
        else:
            out[name] = t
    return out


def save_drafter(drafter: Drafter, folder: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (a TP1 drafter: whole tensors)."""
    if drafter.tp_size != 1:
        raise ValueError("save a drafter built at tp_size 1 (a rank holds only its slice)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(drafter)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    cfg = drafter.config
    cfg.torch_dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return folder


def load_weights(drafter: Drafter, folder: Path) -> None:
    """Copy each checkpoint tensor into this rank's slice; fail on any parameter left unset."""
    params = dict(drafter.named_parameters())
    unset = set(params)
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            target, shard = name, None
            for hf, (ours, piece) in STACKED.items():
                if hf in name:
                    target, shard = name.replace(hf, ours), piece
            param = params.get(target)
            if param is None:
                raise ValueError(f"{folder}: tensor {name} has no parameter in a {drafter.kind} drafter")
            loader = getattr(param, "weight_loader", None)
            tensor = f.get_tensor(name)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)
            unset.discard(target)
    if unset:
        raise ValueError(f"drafter checkpoint {folder} left parameters unset: {sorted(unset)[:8]}")


def load_drafter(path: str | Path, units: Sequence[UnitSpec], *, tp_rank: int = 0, tp_size: int = 1,
                 pp: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Drafter:
    """A drafter from a folder (``pdflow:assets/tiny-dspark`` or a path) for one rank."""
    folder = resolve_model_path(path)
    config = DrafterConfig.from_file(folder)
    drafter = build_drafter(config, units, tp_rank=tp_rank, tp_size=tp_size, pp=pp, dtype=dtype,
                            device=device)
    load_weights(drafter, folder)
    return drafter.eval().requires_grad_(False)
