"""Torch references of the fused MoE kernel (``kernels.fused_moe``): the same routing
layout and the same roundings, one expert at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3-MoE router: softmax over the logits in fp32, top-k, optional
    renormalisation to sum 1, weights cast back to the logits' dtype. -> (weights, ids)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H]; ``w13`` [E, 2N, H] (gate rows then up rows); ``w2`` [E, H, N];
    ``weights``/``ids`` [T, K]. Per (token, pick): gate/up accumulated in fp32,
    ``silu(gate) * up`` rounded to x's dtype, down accumulated in fp32, times the pick's
    weight, rounded; the K picks summed in fp32 and rounded once."""
    t, k = ids.shape
    n = w13.shape[1] // 2
    pairs = torch.zeros(t, k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, pick = torch.where(ids == e)
        gu = x[tok].float() @ w13[e].float().t()
        act = (F.silu(gu[:, :n]) * gu[:, n:]).to(x.dtype)
        down = act.float() @ w2[e].float().t()
        pairs[tok, pick] = (down * weights[tok, pick, None].float()).to(x.dtype).float()
    return pairs.sum(dim=1).to(x.dtype)
