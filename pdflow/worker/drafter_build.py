"""Build the drafter a stage holds: its weights (a checkpoint, the one shipped next to the
target, or random), the target's embedding and LM head, and its draft KV pool.

Under PP the drafter sits on the last stage, which holds no embedding; it gets its own
copy of the target's (the checkpoint's rows, or the random model's first draw), so
drafts on any layout read the same token vectors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.graph import RankPlan, RunGraph, parallel_of
from pdflow.graph.units import DRAFT
from pdflow.model.config import DecoderConfig
from pdflow.model.decoder import CausalLM
from pdflow.model.layers import VocabParallelEmbedding
from pdflow.model.loader import checkpoint_files, random_init
from pdflow.model.paths import resolve_model_path
from pdflow.spec_decode import Drafter, DrafterConfig, build_drafter, drafter_config_for, load_drafter

RANDOM = "random"
EMBED = "model.embed_tokens.weight"


def drafter_checkpoint(spec) -> Path | None:
    """The drafter folder a run asks for: ``drafter.path``; when unset, the one shipped
    next to the target (``<model.path>-<kind>``) if present; None: random weights."""
    d = spec.drafter
    if d.path == RANDOM:
        return None
    if d.path is not None:
        return resolve_model_path(d.path)
    if not spec.model.path:
        return None
    try:
        # A local sibling only: a hub id's ``-<kind>`` is not asked of the hub.
        return resolve_model_path(f"{str(spec.model.path).rstrip('/')}-{d.kind}", hub=False)
    except FileNotFoundError:
        return None


def build_rank_drafter(graph: RunGraph, role: str, me: RankPlan, model: CausalLM, cfg: DecoderConfig,
                       folder: Path | None, device: torch.device, dtype: torch.dtype,
                       backend) -> tuple[Drafter, KVCacheBinding]:
    """The drafter of rank ``me`` (a last-stage rank), bound to the target and its pool."""
    spec = graph.spec
    par = parallel_of(spec, role)
    pp = graph.instance(role).pp
    path = drafter_checkpoint(spec)
    if path is not None:
        DrafterConfig.from_file(path).check_run(spec=spec.drafter, target=cfg, graph_taps=graph.drafter.taps)
        drafter = load_drafter(path, me.units, tp_rank=me.tp_rank, tp_size=par.tp, pp=pp, dtype=dtype,
                               device=device)
    else:
        dcfg = drafter_config_for(graph, cfg)
        drafter = build_drafter(dcfg, me.units, tp_rank=me.tp_rank, tp_size=par.tp, pp=pp, dtype=dtype,
                                device=device)
        random_init(drafter, seed=spec.seed + 1)
        drafter.eval().requires_grad_(False)
    drafter.bind_target(_embedding(model, cfg, folder, me, par.tp, device, dtype, spec.seed), model.lm_head)
    pool = KVCacheBinding([u for u in me.units if u.family == DRAFT], graph.budgets[role].pool_blocks, device)
    drafter.bind_cache(pool.caches, backend)
    return drafter, pool


def _embedding(model: CausalLM, cfg: DecoderConfig, folder: Path | None, me: RankPlan, tp: int,
               device: torch.device, dtype: torch.dtype, seed: int):
    if model.model.embed_tokens is not None:
        return model.model.embed_tokens
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, me.tp_rank, tp)
    finally:
        torch.set_default_dtype(previous)
    if folder is not None:
        full = _checkpoint_tensor(folder, EMBED)
    else:  # what ``random_init`` draws first for a whole model: its embedding
        full = torch.randn((cfg.vocab_size, cfg.hidden_size), generator=torch.Generator().manual_seed(seed)) * 0.02
    with torch.no_grad():
        embed.weight_loader(embed.weight, full.to(device=device, dtype=dtype))
    return embed.requires_grad_(False)


def _checkpoint_tensor(folder: Path, name: str) -> torch.Tensor:
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                return f.get_tensor(name)
    raise ValueError(f"checkpoint {folder} has no {name}: the drafter shares the target's embedding")
