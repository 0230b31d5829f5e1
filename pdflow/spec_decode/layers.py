"""A draft decoder layer split into the pieces drafters compose differently.

DSpark attends over paged context plus an in-flight block, chains over their paged
entries, training over dense masks; all three use the same projections, so the layer
exposes them (q/k/v, K/V only, the output half) instead of one forward. Weights are the
model package's TP-sharded layers: KV heads split over ranks exactly as the target's
(``rank_heads``), which is how the graph places draft heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdflow.model.config import DecoderConfig
from pdflow.model.decoder import MLP
from pdflow.model.layers import QKVParallelLinear, RMSNorm, RowParallelLinear, linear
from pdflow.model.rope import RotaryEmbedding


class DraftAttention(nn.Module):
    """Projections only; which keys a query sees is the drafter's business."""

    def __init__(self, cfg: DecoderConfig, tp_rank: int, tp_size: int):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, tp_rank, tp_size
        )
        self.num_heads = self.qkv_proj.local_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.head_dim = d
        self.scale = d**-0.5
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, tp_rank, tp_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None


class DraftLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp_rank, tp_size)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """q [N, H_q, D], k/v [N, H_kv, D] of residual rows x [N, hidden], rotated."""
        a = self.self_attn
        n, d = x.shape[0], a.head_dim
        q, k, v = self.self_attn.qkv_proj(self.input_layernorm(x)).split(
            [a.num_heads * d, a.num_kv_heads * d, a.num_kv_heads * d], dim=-1
        )
        q, k, v = q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = rope(positions, q, k)
        return q, k, v

    def kv(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """K/V only (no wasted q) of rows h [N, hidden] that are already normalised, rotated."""
        a = self.self_attn
        n, d = h.shape[0], a.head_dim
        q_rows = a.num_heads * d
        weight = a.qkv_proj.weight[q_rows:]
        bias = None if a.qkv_proj.bias is None else a.qkv_proj.bias[q_rows:]
        k, v = linear(h, weight, bias).split([a.num_kv_heads * d] * 2, dim=-1)
        k, v = k.reshape(n, -1, d), v.reshape(n, -1, d)
        if a.k_norm is not None:
            k = a.k_norm(k)
        return rope.forward_joint(positions, k), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual rows x [N, hidden] after attention output attn [N, H_q, D]."""
        x = x + self.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def rotary(cfg: DecoderConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [N, M, H_q, D] over k/v [N, L, H_kv, D] where ``visible`` [N, M, L] (or [M, L])
    is True; GQA by repeating KV heads. Returns [N, M, H_q, D]. Training's path."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    mask = visible if visible.dim() == 3 else visible[None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)
