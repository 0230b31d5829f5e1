"""Small targets and drafters for the spec_decode tests, placed by the real graph."""

from __future__ import annotations

import torch

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.attention.metadata import AttentionMetadata
from pdflow.graph import build_graph
from pdflow.model.config import DecoderConfig
from pdflow.model.loader import build_model, random_init
from pdflow.spec.load import compose_spec
from pdflow.spec_decode.checkpoint import build_drafter, drafter_config_for
from pdflow.spec_decode.drafter import ContextBatch

CPU = torch.device("cpu")
BLOCK = 32  # two draft pages of 16 per block
SMALL_MODEL = [
    "model.layers=6", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.head_dim=16",
    "model.intermediate=128", "model.vocab=48", "model.path=null", "model.dtype=fp32",
    "model.max_model_len=512",
]


def small_graph(kind: str = "dspark", *, tp: int = 1, prefill: str = "tp1", extra: tuple[str, ...] = ()):
    overrides = [
        *SMALL_MODEL, f"drafter={kind}", f"prefill={prefill}", f"decode=tp{tp}",
        f"decode.block_size={BLOCK}", "decode.kv_page_tokens=16", f"prefill.block_size={BLOCK}",
        "prefill.kv_page_tokens=16", "tracking=off",
    ]
    if kind == "dspark":
        overrides += ["drafter.layers=2", "drafter.num_taps=3"]
    return build_graph(compose_spec([*overrides, *extra]))


def small_target(graph, *, seed: int = 0, tp_rank: int = 0, tp_size: int = 1):
    cfg = DecoderConfig.from_model_spec(graph.spec.model)
    model = build_model(cfg, folder=None, dtype=torch.float32, device=CPU, seed=seed,
                        tp_rank=tp_rank, tp_size=tp_size)
    with torch.no_grad():  # larger weights than the default 0.02 so features differ by row
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return cfg, model


def small_drafter(graph, cfg, target, *, role: str = "decode", rank: int = 0, seed: int = 1,
                  num_blocks: int = 24, taps: tuple[int, ...] | None = None):
    """A randomly initialised drafter of the graph's kind, bound to the target and a pool."""
    dcfg = drafter_config_for(graph, cfg, taps=taps)
    plan = graph.rank(role, rank)
    drafter = build_drafter(dcfg, plan.units, tp_rank=plan.tp_rank, tp_size=graph.instance(role).tp,
                            dtype=torch.float32, device=CPU)
    random_init(drafter, seed=seed, std=0.3)
    drafter.requires_grad_(False)
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    binding = KVCacheBinding([u for u in plan.units if u.family == "draft"], num_blocks, CPU)
    drafter.bind_cache(binding.caches, get_backend("torch"))
    return drafter, binding


def block_table(blocks: list[int]) -> torch.Tensor:
    return torch.tensor([blocks], dtype=torch.int32)


def slots(blocks: list[int], start: int, stop: int) -> torch.Tensor:
    pos = torch.arange(start, stop)
    return torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK


class TargetRunner:
    """Runs the small target over one request's chunks with a paged pool, capturing taps."""

    def __init__(self, model, cfg, *, taps: tuple[int, ...], blocks: list[int], num_blocks: int = 24):
        from pdflow.graph.units import TARGET, UnitSpec

        self.model, self.cfg, self.taps, self.blocks = model, cfg, taps, blocks
        units = [UnitSpec(family=TARGET, field=f, layer=i, heads=tuple(range(cfg.num_kv_heads)),
                          head_dim=cfg.head_dim, dtype="fp32", page_tokens=16, block_size=BLOCK)
                 for i in range(cfg.num_layers) for f in ("k", "v")]
        KVCacheBinding(units, num_blocks, CPU).bind(model.attention_layers(), get_backend("torch"))

    def forward(self, ids: torch.Tensor, start: int):
        """Rows [start, start + len(ids)): (final hidden [T, h], taps [T, n*h], logits [T, V])."""
        n = ids.numel()
        meta = AttentionMetadata(
            decode_only=False, slot_mapping=slots(self.blocks, start, start + n),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            context_lens=torch.tensor([start + n], dtype=torch.int32),
            block_tables=block_table(self.blocks), max_seqlen_q=n,
        )
        hidden, taps = self.model.forward_with_taps(ids, torch.arange(start, start + n), meta, self.taps)
        tap_cat = torch.cat(taps, dim=-1) if taps else hidden
        return hidden, tap_cat, self.model.compute_logits(hidden)

    def context(self, seq_id: str, ids: torch.Tensor, start: int, features: torch.Tensor,
                next_token: int = -1) -> ContextBatch:
        n = ids.numel()
        return ContextBatch(
            seq_ids=[seq_id], cu_seqlens=[0, n], start_positions=[start], features=features,
            positions=torch.arange(start, start + n), slot_mapping=slots(self.blocks, start, start + n),
            token_ids=ids, next_token_ids=[next_token],
        )
