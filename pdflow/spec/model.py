"""Model geometry: what the graph needs to place layers and size KV units."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from pdflow.spec.dtypes import canonical_dtype


def is_sparse_layer(layer: int, experts: int, mlp_only_layers: list[int] | None, sparse_step: int) -> bool:
    """transformers' Qwen3-MoE rule: global ``layer`` holds experts unless the model is
    dense or lists it in ``mlp_only_layers``, and when (layer + 1) % ``sparse_step`` == 0."""
    return experts > 0 and layer not in (mlp_only_layers or ()) and (layer + 1) % sparse_step == 0


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """A GQA decoder's geometry; ``path`` points at a HF checkpoint when one is served."""

    name: str = MISSING
    architecture: str = "LlamaForCausalLM"
    layers: int = MISSING
    hidden: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    head_dim: int = MISSING
    intermediate: int = MISSING
    vocab: int = MISSING
    dtype: str = "bf16"
    # KV cache and stored-weight dtypes when they differ from the compute dtype.
    kv_dtype: str = "auto"
    weight_dtype: str = "auto"
    max_model_len: int = 4096
    # A HF checkpoint: a folder, ``pdflow:<folder in the package>``, or a hub id
    # (``Qwen/Qwen3-0.6B``, resolved through huggingface_hub's cache) at ``revision``.
    path: str | None = None
    # The hub revision (branch, tag or commit) of a hub id; None: main.
    revision: str | None = None
    # Total parameters when the dense estimate from the geometry is wrong (MoE models).
    param_count: int | None = None
    # Sparse-attention facts (MiniMax-M3 style): layers that also cache an indexer key
    # per token (None: none do), and that key's width and dtype.
    indexer_layers: list[int] | None = None
    indexer_key_dim: int = 0
    indexer_dtype: str = "fp8_e4m3"
    # Mixture of experts (Qwen3-MoE; 0 experts: dense). A layer is sparse unless listed in
    # ``mlp_only_layers`` and when (layer + 1) % ``sparse_step`` == 0, as transformers builds it;
    # ``intermediate`` stays the dense layers' width, ``moe_intermediate`` one expert's.
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    mlp_only_layers: list[int] | None = None
    sparse_step: int = 1

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"model.{field_name} must be positive, got {getattr(self, field_name)}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model.heads ({self.heads}) must be a multiple of model.kv_heads ({self.kv_heads}) for GQA"
            )
        self.dtype = canonical_dtype(self.dtype, "model.dtype")
        if self.kv_dtype == "auto":
            self.kv_dtype = self.dtype
        else:
            self.kv_dtype = canonical_dtype(self.kv_dtype, "model.kv_dtype")
        if self.weight_dtype != "auto":
            self.weight_dtype = canonical_dtype(self.weight_dtype, "model.weight_dtype")
        self.indexer_dtype = canonical_dtype(self.indexer_dtype, "model.indexer_dtype")
        if self.indexer_layers:
            bad = [i for i in self.indexer_layers if not 0 <= i < self.layers]
            if bad:
                raise ValueError(f"model.indexer_layers {bad} lie outside 0..{self.layers - 1}")
            if self.indexer_key_dim <= 0:
                raise ValueError("model.indexer_key_dim must be positive when indexer_layers is set")

        if self.experts:
            if not 0 < self.experts_per_token <= self.experts or self.moe_intermediate <= 0:
                raise ValueError(
                    f"model.experts={self.experts} needs 0 < experts_per_token "
                    f"({self.experts_per_token}) <= experts and moe_intermediate > 0 "
                    f"({self.moe_intermediate})")
            if self.sparse_step <= 0:
                raise ValueError(f"model.sparse_step must be positive, got {self.sparse_step}")

    @property
    def stored_weight_dtype(self) -> str:
        return self.dtype if self.weight_dtype == "auto" else self.weight_dtype

    def dense_params_per_layer(self) -> int:
        """Attention + SwiGLU MLP + two norms, the Llama/Qwen shape."""
        attn = self.hidden * self.head_dim * (self.heads * 2 + self.kv_heads * 2)
        mlp = 3 * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global ``layer`` holds experts (transformers' Qwen3-MoE rule)."""
        return is_sparse_layer(layer, self.experts, self.mlp_only_layers, self.sparse_step)

    def moe_params_per_layer(self) -> int:
        """Attention, the router and every expert's SwiGLU (all held: no expert parallelism)."""
        dense = self.dense_params_per_layer() - 3 * self.hidden * self.intermediate
        return dense + self.experts * self.hidden + self.experts * 3 * self.hidden * self.moe_intermediate

    def layer_params(self, layer: int) -> int:
        """Parameters of global ``layer``: dense or sparse by the geometry, or the
        ``param_count`` estimate spread evenly when one is given."""
        if self.param_count is not None:
            return max(0, self.param_count - 2 * self.vocab * self.hidden) // self.layers
        return self.moe_params_per_layer() if self.is_moe_layer(layer) else self.dense_params_per_layer()

    def params_per_layer(self) -> int:
        """The mean over layers (the per-layer figure of the budget's stage sums)."""
        return sum(self.layer_params(i) for i in range(self.layers)) // self.layers
