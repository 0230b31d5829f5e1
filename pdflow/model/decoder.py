"""GQA decoder for the Llama, Qwen3 and Qwen3-MoE families, buildable as a slice of
layers (PP); a Qwen3-MoE layer's MLP is ``pdflow.model.moe.SparseMoeBlock``.

Parameter names follow HF (``model.layers.<global i>.self_attn...``) except that q/k/v
and gate/up are stacked (``qkv_proj``, ``gate_up_proj``); the loader maps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdflow.attention.layer import PagedAttention
from pdflow.attention.metadata import AttentionMetadata
from pdflow.model import fused as fusion
from pdflow.model.config import DecoderConfig
from pdflow.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdflow.model.moe import SparseMoeBlock
from pdflow.model.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, rope: RotaryEmbedding, tp_rank, tp_size):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
            tp_rank, tp_size,
        )
        self.num_heads = self.qkv_proj.local_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, tp_rank, tp_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope  # one table shared by all layers; its buffers are not persistent
        self.attn = PagedAttention(
            layer=layer, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=d, scale=d**-0.5,
        )

    def project(self, x, positions, slot_mapping, fused: bool = False, *, into: torch.Tensor | None = None):
        """q, k, v ([T, H, D]) of ``x``, rotated, and whether their K/V is already in the
        bound caches (the fused kernel writes it). ``into`` ([T, (H_q + 2 H_kv) * D]): a
        buffer the three are written to and returned as views of (a piecewise CUDA graph's
        static buffer between this projection and the attention)."""
        t, d, hq, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        if fused:  # one kernel: qk-norm, RoPE in place, and the KV write when bound
            if into is not None:
                qkv = into.copy_(qkv)
            # (an fp8 cache is written by the backend's quantizing store instead)
            bound = self.attn.k_cache is not None and not self.attn.quantized
            kv = (self.attn.k_cache, self.attn.v_cache, slot_mapping) if bound else None
            q, k, v = self.rope.rotate_qkv_(
                positions, qkv, hq, hkv, q_norm=self.q_norm, k_norm=self.k_norm, kv_cache=kv
            )
            return q, k, v, bound
        if self.q_norm is None:  # q and k heads are adjacent in qkv: rotate them together
            qk = self.rope.forward_joint(positions, qkv[:, : (hq + hkv) * d].view(t, -1, d))
            q, k = qk.split([hq, hkv], dim=1)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        else:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
            q, k = self.rope(positions, self.q_norm(q), self.k_norm(k))
        if into is not None:
            views = into.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = (view.view(t, -1, d).copy_(src) for view, src in zip(views, (q, k, v), strict=True))
        return q, k, v, False


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, tp_rank, tp_size):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [i, i], False, tp_rank, tp_size
        )
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, tp_rank, tp_size)

    def forward(self, x, fused: bool = False):
        gate_up = self.gate_up_proj(x)
        if fused:
            return self.down_proj(fusion.ops().silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, rope, tp_rank, tp_size):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rope, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.is_moe_layer(layer)
        self.mlp = SparseMoeBlock(cfg, tp_rank, tp_size) if sparse else MLP(cfg, tp_rank, tp_size)

    def forward(self, x, residual, positions, meta, fused: bool = False):
        """``x`` is the last branch's output and ``residual`` the stream before it (None
        at a stage's first layer: x is the stream). Returns the same pair for the next
        layer; their sum is the residual stream after this layer."""
        q, k, v, stored, residual = self.before_attention(x, residual, positions, meta.slot_mapping, fused)
        out = self.self_attn.attn(q, k, v, meta, kv_stored=stored)
        return self.after_attention(out, residual, fused)

    def before_attention(self, x, residual, positions, slot_mapping, fused: bool = False, *, into=None):
        """The layer up to its attention: (q, k, v, K/V stored, residual stream)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, fused=fused)
        else:
            h, residual = self.input_layernorm(x, residual, fused=fused)
        return (*self.self_attn.project(h, positions, slot_mapping, fused, into=into), residual)

    def after_attention(self, out, residual, fused: bool = False):
        """The layer from its attention's output ([T, H_q, D]) on: (branch output, residual)."""
        attn = self.self_attn
        h = attn.o_proj(out.reshape(out.shape[0], attn.num_heads * attn.head_dim))
        h, residual = self.post_attention_layernorm(h, residual, fused=fused)
        return self.mlp(h, fused), residual


class DecoderBody(nn.Module):
    """Embeddings (first stage), the stage's layers keyed by global index, norm (last)."""

    def __init__(self, cfg: DecoderConfig, layer_range: range, tp_rank: int, tp_size: int):
        super().__init__()
        self.is_first = layer_range.start == 0
        self.is_last = layer_range.stop == cfg.num_layers
        rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.rotary = rope
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size)
            if self.is_first else None
        )
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i, rope, tp_rank, tp_size) for i in layer_range}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None


class CausalLM(nn.Module):
    """One pipeline stage of the decoder (the whole model when ``layer_range`` is None)."""

    def __init__(
        self, cfg: DecoderConfig, *, layer_range: range | None = None, tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        self.config = cfg
        self.layer_range = layer_range if layer_range is not None else range(cfg.num_layers)
        if not 0 <= self.layer_range.start < self.layer_range.stop <= cfg.num_layers:
            raise ValueError(f"layer_range {self.layer_range} outside 0..{cfg.num_layers}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Fused Triton kernels: True/False, or None for auto (CUDA + triton backend).
        self.fused_kernels: bool | None = fusion.setting_from_env()
        self.model = DecoderBody(cfg, self.layer_range, tp_rank, tp_size)
        self.lm_head = (
            ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size)
            if self.model.is_last else None
        )
        if self.lm_head is not None and self.model.is_first and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers.values()]

    def uses_fused_kernels(self, x: torch.Tensor) -> bool:
        """Whether a forward pass on ``x`` runs the fused kernels (``pdflow.model.fused``)."""
        first = next(iter(self.model.layers.values())).self_attn.attn
        return fusion.enabled(self.fused_kernels, x, first.backend)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Token ids [T] on the first stage, hidden states [T, hidden] on later ones.
        Returns hidden states (normed on the last stage)."""
        return self.forward_with_taps(inputs, positions, meta, ())[0]

    def forward_with_taps(
        self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Also return the residual stream after each layer in ``taps`` (global ids held by
        this stage, in order): what a drafter reads from the target."""
        x = self.model.embed_tokens(inputs) if self.model.is_first else inputs
        fused = self.uses_fused_kernels(x)
        residual, captured = None, []
        for index, layer in self.model.layers.items():
            x, residual = layer(x, residual, positions, meta, fused)
            if int(index) in taps:
                captured.append(x + residual)
        if len(captured) != len(taps):
            held = list(self.model.layers)
            raise ValueError(f"taps {list(taps)} are not all among this stage's layers {held}")
        if self.model.is_last:
            return self.model.norm(x, residual, fused=fused)[0], captured
        return x + residual, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
