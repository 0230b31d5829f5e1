"""Torch references for the fused elementwise kernels (RMSNorm + residual, SiLU-and-mul,
RoPE on the fused qkv output): exactly the unfused model's arithmetic, rounding included.

Each rounds where the model's unfused torch ops round (a 16-bit tensor between two ops is
a 16-bit value), so the Triton kernels are held to the numbers the CPU path produces: the
residual sum is taken in the input dtype, RMSNorm statistics in fp32 with the weight
applied after casting back (as HF), SiLU rounded before the product, and RoPE rotates in
fp32 from the fp32 cos/sin table of ``pdflow.model.rope``.
"""

from __future__ import annotations

import torch

__all__ = ["qk_rope", "rms_norm", "silu_and_mul"]


def rms_norm(x, weight, eps: float, residual=None):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, statistics in fp32.

    With ``residual``: ``(norm(x + residual), x + residual)``, the sum in x's dtype (the
    residual stream a decoder layer carries to the next norm)."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed if residual is None else (normed, x)


def silu_and_mul(gate_up):
    """``silu(gate) * up`` of the stacked ``[..., 2 * I]`` gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_rope(qkv, positions, cos_table, sin_table, num_q_heads: int, num_kv_heads: int,
            head_dim: int, q_weight=None, k_weight=None, eps: float = 1e-6):
    """Rotate the q and k heads of a fused ``[T, (H_q + 2 H_kv) * D]`` qkv row by row
    (neox style: halves, not interleaved pairs) at ``positions``, after a per-head RMSNorm
    when ``q_weight``/``k_weight`` are given (Qwen3's qk-norm). Returns (q, k, v) as new
    ``[T, H, D]`` tensors; qkv is left as it was."""
    t, d = qkv.shape[0], head_dim
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k, v = q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d).clone()
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v
