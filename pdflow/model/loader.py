"""Load a HF checkpoint (config.json + safetensors, sharded or not) into a CausalLM stage,
or initialise one randomly for benchmarks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdflow.model.config import DecoderConfig
from pdflow.model.decoder import CausalLM
from pdflow.model.moe import ExpertWeights
from pdflow.model.paths import resolve_model_path
from pdflow.spec import ModelSpec

# HF name fragment -> (our stacked parameter fragment, shard id for its weight_loader).
STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names, else every one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in {folder}")
    return files


# One expert's tensor in the released Qwen3-MoE layout -> the layer's stacked parameter.
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _target(name: str) -> tuple[str, object]:
    expert = EXPERT.match(name)
    if expert:
        prefix, index, kind = expert.groups()
        stacked = "down_proj" if kind == "down" else "gate_up_proj"
        return f"{prefix}.{stacked}", (kind, int(index))
    for hf, (ours, shard) in STACKED.items():
        if hf in name:
            return name.replace(hf, ours), shard
    return name, None


def _copy_whole(param, loaded, shard=None) -> None:
    param.data.copy_(loaded)


def load_weights(model: CausalLM, folder: Path) -> None:
    """Copy every checkpoint tensor this stage owns into it; fail on any it leaves unset."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unset = {n for n in params}
    tie = model.config.tie_word_embeddings
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                targets = [_target(name)]
                if tie and name == "model.embed_tokens.weight":
                    targets.append(("lm_head.weight", None))
                for pname, shard in targets:
                    param = params.get(pname)
                    if param is None:
                        continue  # another stage's layer, or a buffer like rotary inv_freq
                    loader = getattr(param, "weight_loader", _copy_whole)
                    loader(param, f.get_tensor(name), shard)
                    unset.discard(pname)
    # A stacked parameter is set once all its pieces came; the check above is per name.
    for name, module in model.named_modules():
        if isinstance(module, ExpertWeights) and module.missing():
            unset.add(f"{name} pieces {module.missing()[:4]}")
    if unset:
        raise ValueError(f"checkpoint {folder} left parameters unset: {sorted(unset)[:8]}")


def random_init(model: CausalLM, *, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) weights, unit norms: a stand-in when no checkpoint is needed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def model_config(model: ModelSpec) -> tuple[Path | None, DecoderConfig]:
    """The checkpoint folder (None: a random model of the spec's geometry) and its config,
    checked against the spec."""
    folder = resolve_model_path(model.path, model.revision) if model.path else None
    cfg = DecoderConfig.from_file(folder) if folder else DecoderConfig.from_model_spec(model)
    cfg.check_matches(model)
    return folder, cfg


def build_model(
    cfg: DecoderConfig, *, folder: Path | None, dtype: torch.dtype, device: torch.device,
    layer_range: range | None = None, tp_rank: int = 0, tp_size: int = 1, seed: int = 0,
) -> CausalLM:
    """A stage on ``device`` in ``dtype``: loaded from ``folder``, else random (seeded)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in their final dtype and place
    try:
        with torch.device(device):
            model = CausalLM(cfg, layer_range=layer_range, tp_rank=tp_rank, tp_size=tp_size)
    finally:
        torch.set_default_dtype(previous)
    if folder is None:
        random_init(model, seed=seed)
    else:
        load_weights(model, folder)
    return model.eval().requires_grad_(False)
