"""The KV cache binding: one tensor per (layer, field) laid out exactly as its UnitSpec."""

from __future__ import annotations

import torch

from pdflow.graph.units import UnitSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn,
                # Scale units: a biased power-of-two exponent per byte (kernels/kv_quant.py).
                "e8m0": torch.uint8}


class KVCacheBinding:
    """Allocates each unit's cache tensor and attaches K/V pairs to the attention layers."""

    def __init__(self, units: list[UnitSpec], num_blocks: int, device: torch.device):
        for u in units:
            if u.page_tokens is None:
                raise ValueError(f"{u.name}: a KV binding must declare its page_tokens")
        self.units = {(u.layer, u.field): u for u in units}
        self.num_blocks = num_blocks
        self.caches = {
            key: torch.zeros(u.cache_shape(num_blocks), dtype=TORCH_DTYPES[u.dtype], device=device)
            for key, u in self.units.items()
        }

    def by_name(self) -> dict[str, torch.Tensor]:
        """Each unit's cache tensor under its unit name (global layer numbering)."""
        return {u.name: self.caches[key] for key, u in self.units.items()}

    def bind(self, attention_layers, backend) -> None:
        for attn in attention_layers:
            attn.k_cache = self.caches[(attn.layer, "k")]
            attn.v_cache = self.caches[(attn.layer, "v")]
            attn.k_scale = self.caches.get((attn.layer, "k_scale"))
            attn.v_scale = self.caches.get((attn.layer, "v_scale"))
            attn.backend = backend
