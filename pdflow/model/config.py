"""The decoder's geometry, read from a HF ``config.json`` or built from a ModelSpec."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdflow.spec.checkpoint import GEOMETRY_KEYS, geometry_mismatches, hf_architecture, hf_geometry
from pdflow.spec.model import is_sparse_layer

# Architectures whose attention normalises q and k per head before RoPE.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3MoeForCausalLM")


@dataclass(kw_only=True, slots=True)
class DecoderConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF rope parameters without theta: {"rope_type": "llama3", "factor": ...}; None = default.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # Mixture of experts (Qwen3-MoE; 0 experts: every layer dense). See ``is_moe_layer``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Renormalise the top-k routing weights to sum to 1 (Qwen3-MoE: true in released models).
    norm_topk_prob: bool = False
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads, {self.num_kv_heads} KV heads: not GQA")

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: sparse unless in mlp_only_layers, every decoder_sparse_step-th."""
        return is_sparse_layer(layer, self.num_experts, self.mlp_only_layers, self.decoder_sparse_step)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DecoderConfig:
        arch = hf_architecture(raw)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not one of {SUPPORTED_ARCHITECTURES}")
        geo = hf_geometry(raw)
        # transformers 5 writes rope_parameters (theta inside); 4.x rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=geo["vocab"],
            hidden_size=geo["hidden"],
            num_layers=geo["layers"],
            num_heads=geo["heads"],
            num_kv_heads=geo["kv_heads"],
            head_dim=geo["head_dim"],
            intermediate_size=geo["intermediate"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=geo["max_model_len"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            num_experts=geo["experts"],
            num_experts_per_tok=geo["experts_per_token"],
            moe_intermediate_size=geo["moe_intermediate"],
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            mlp_only_layers=list(geo["mlp_only_layers"] or []),
            decoder_sparse_step=geo["sparse_step"],
        )

    @classmethod
    def from_file(cls, folder: Path) -> DecoderConfig:
        return cls.from_hf_dict(json.loads((folder / "config.json").read_text()))

    @classmethod
    def from_model_spec(cls, spec) -> DecoderConfig:
        """Geometry of a ``pdflow.spec.ModelSpec`` (random-init benchmarks)."""
        return cls(
            architecture=spec.architecture,
            vocab_size=spec.vocab,
            hidden_size=spec.hidden,
            num_layers=spec.layers,
            num_heads=spec.heads,
            num_kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate,
            max_position_embeddings=spec.max_model_len,
            qk_norm=spec.architecture in QK_NORM_ARCHITECTURES,
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate,
            norm_topk_prob=spec.experts > 0,
            mlp_only_layers=list(spec.mlp_only_layers or []),
            decoder_sparse_step=spec.sparse_step,
        )

    def to_model_spec(self, *, name: str, path: str | None, dtype: str, max_model_len: int):
        """The run graph's view of this checkpoint (geometry only)."""
        from pdflow.spec import ModelSpec

        return ModelSpec(
            name=name, architecture=self.architecture, layers=self.num_layers,
            hidden=self.hidden_size, heads=self.num_heads, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=self.intermediate_size, vocab=self.vocab_size,
            dtype=dtype, max_model_len=max_model_len, path=path,
            experts=self.num_experts, experts_per_token=self.num_experts_per_tok,
            moe_intermediate=self.moe_intermediate_size,
            mlp_only_layers=sorted(self.mlp_only_layers) or None,
            sparse_step=self.decoder_sparse_step,
        )

    def geometry(self) -> dict[str, Any]:
        """This config's values of the ModelSpec geometry fields (GEOMETRY_KEYS)."""
        values = {
            "architecture": self.architecture, "layers": self.num_layers,
            "hidden": self.hidden_size, "heads": self.num_heads, "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate": self.intermediate_size,
            "vocab": self.vocab_size, "experts": self.num_experts,
            "experts_per_token": self.num_experts_per_tok,
            "moe_intermediate": self.moe_intermediate_size,
            "mlp_only_layers": sorted(self.mlp_only_layers) or None,
            "sparse_step": self.decoder_sparse_step,
        }
        return {k: values[k] for k in GEOMETRY_KEYS}

    def check_matches(self, spec) -> None:
        """Refuse a ModelSpec whose geometry disagrees with the checkpoint it points at:
        the graph would place heads and size units for a model that is not there (the
        graph refuses it at plan time too: MODEL_GEOMETRY_MISMATCH)."""
        wrong = geometry_mismatches(spec, self.geometry())
        if wrong:
            detail = ", ".join(f"{k}: spec {a} vs checkpoint {b}" for k, a, b in wrong)
            raise ValueError(f"model spec {spec.name!r} disagrees with {spec.path}: {detail}")
