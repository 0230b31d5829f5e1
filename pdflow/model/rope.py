"""Rotary position embedding with the checkpoint's theta and scaling, cos/sin precomputed."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdflow.model import fused as fusion


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair frequencies (fp32), following the HF definitions of each rope_type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE over a table of ``max_positions`` positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False
        )
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H_q, D], k [T, H_kv, D] rotated at ``positions`` [T]."""
        cos, sin = self._table(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_joint(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """q and k heads side by side ([T, H_q + H_kv, D], e.g. a view of the fused qkv
        output) rotated in one pass: half the elementwise calls of ``forward``, same values."""
        cos, sin = self._table(positions)
        return _rotate(qk, cos, sin)

    def rotate_qkv_(
        self, positions: torch.Tensor, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
        *, q_norm=None, k_norm=None, kv_cache: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused path: q and k heads of ``qkv [T, (H_q + 2 H_kv) * D]`` normalised
        (``q_norm``/``k_norm``: RMSNorm modules, Qwen3) and rotated in place by one
        kernel, which also stores k and v when given ``kv_cache = (k_cache, v_cache,
        slot_mapping)``. Returns (q, k, v) as ``[T, H, D]`` views of qkv."""
        k_cache, v_cache, slots = kv_cache if kv_cache is not None else (None, None, None)
        return fusion.ops().qk_rope_(
            qkv, positions, self.cos, self.sin, num_q_heads, num_kv_heads, 2 * self.cos.shape[1],
            q_weight=None if q_norm is None else q_norm.weight,
            k_weight=None if k_norm is None else k_norm.weight,
            eps=1e-6 if q_norm is None else q_norm.eps,
            k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
        )

    def _table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows at ``positions``, [T, 1, D/2]. Every layer of a step passes the same
        positions tensor, so on CPU they are looked up once per step (keyed on the tensor
        and, outside inference mode, its version counter: the engine builds positions
        anew each step, as the attention metadata); elsewhere always afresh, so a captured
        CUDA graph records the lookup."""
        key = (positions, None if positions.is_inference() else positions._version)
        memo = getattr(self, "_memo", None)
        if memo is not None and memo[0] is key[0] and memo[1] == key[1]:
            return memo[2], memo[3]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if positions.device.type == "cpu":
            self._memo = (*key, cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
