"""The fastest a batched greedy run could go on a device: the yardstick of the engine bench.

Prefill is priced as compute (its matmul and causal attention FLOPs at a measured GEMM
rate), each decode step as memory traffic (every weight and every live KV byte read once
at a measured HBM rate), each phase taking whichever bound is larger. Only the sampled
rows pay for the LM head (one per sequence at prefill, as the engine computes logits).
An MoE layer's bytes are its router and the experts the step's rows are expected to hit
under uniform routing (``experts_hit``: k of them for one row, nearly all at batch 64).
The rates are measured in the same run as the engine, so the share is machine-relative.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.model.config import DecoderConfig


@dataclass(kw_only=True, slots=True)
class Workload:
    batch: int
    prompt_len: int
    output_len: int
    dtype_bytes: int
    kv_dtype_bytes: int | None = None  # None: the weights' dtype


@dataclass(kw_only=True, slots=True)
class Roofline:
    prefill_flops: float
    weight_bytes: float
    decode_kv_bytes: float  # live KV read over all decode steps
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def step_s(self) -> float:
        """Mean decode step at the roofline."""
        return self.decode_s / max(1, self.decode_steps)


def _attention_params(cfg: DecoderConfig) -> int:
    d, h, hkv, hid = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    return hid * (h + 2 * hkv) * d + h * d * hid


def expert_params(cfg: DecoderConfig) -> int:
    """One expert's SwiGLU (gate, up, down)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def experts_hit(cfg: DecoderConfig, tokens: int) -> float:
    """Expected distinct experts a layer reads for ``tokens`` routed uniformly at random
    (top-k without repeats): k for one token, nearly all of them for a large batch. What
    an MoE step's active-parameter bytes are at that batch."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** max(1, tokens))


def layer_matmul_params(cfg: DecoderConfig, layer: int = 0) -> int:
    """Weights one token multiplies through in decoder ``layer`` (qkv, o, gate_up, down;
    a sparse layer's router and its k experts)."""
    if cfg.is_moe_layer(layer):
        mlp = cfg.num_experts * cfg.hidden_size + cfg.num_experts_per_tok * expert_params(cfg)
    else:
        mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return _attention_params(cfg) + mlp


def token_matmul_params(cfg: DecoderConfig) -> int:
    """Every layer's ``layer_matmul_params``: what one token multiplies through."""
    return sum(layer_matmul_params(cfg, i) for i in range(cfg.num_layers))


def weight_bytes(cfg: DecoderConfig, dtype_bytes: int, tokens: int = 1) -> int:
    """Bytes a step over ``tokens`` rows reads: every layer's matmuls and norms (a sparse
    layer: its router and the experts the rows hit, ``experts_hit``), the final norm and
    the LM head (the embedding is only gathered: a few rows, unless tied to the head)."""
    total = 0.0
    for layer in range(cfg.num_layers):
        total += _attention_params(cfg) + 2 * cfg.hidden_size
        if cfg.qk_norm:
            total += 2 * cfg.head_dim
        if cfg.is_moe_layer(layer):
            total += cfg.num_experts * cfg.hidden_size + experts_hit(cfg, tokens) * expert_params(cfg)
        else:
            total += 3 * cfg.hidden_size * cfg.intermediate_size
    head = cfg.vocab_size * cfg.hidden_size
    return int((total + cfg.hidden_size + head) * dtype_bytes)


def kv_bytes_per_token(cfg: DecoderConfig, kv_dtype_bytes: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes


def prefill_flops(cfg: DecoderConfig, batch: int, prompt_len: int) -> float:
    """Matmuls over every prompt token, causal attention (QK and PV, 2 FLOPs a MAC, each
    query over the positions up to its own), one LM-head row per sequence."""
    tokens = batch * prompt_len
    linear = 2.0 * token_matmul_params(cfg) * tokens
    pairs = prompt_len * (prompt_len + 1) / 2  # (query, key) pairs of one causal sequence
    attention = 4.0 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers * batch
    head = 2.0 * cfg.vocab_size * cfg.hidden_size * batch
    return linear + attention + head


def roofline(cfg: DecoderConfig, work: Workload, *, flops_per_s: float,
             bytes_per_s: float) -> Roofline:
    """Prefill of the whole batch at once, then ``output_len - 1`` decode steps (the first
    token comes from the prefill); decode step ``j`` reads ``prompt_len + j`` KV tokens
    of every sequence (the one it writes included)."""
    kv_bytes = work.kv_dtype_bytes or work.dtype_bytes
    weights = weight_bytes(cfg, work.dtype_bytes, work.batch)
    flops = prefill_flops(cfg, work.batch, work.prompt_len)
    prefill_weights = weight_bytes(cfg, work.dtype_bytes, work.batch * work.prompt_len)
    prefill_s = max(flops / flops_per_s, prefill_weights / bytes_per_s)
    steps = max(0, work.output_len - 1)
    per_token = kv_bytes_per_token(cfg, kv_bytes) * work.batch
    decode_s, kv_total = 0.0, 0.0
    step_flops = 2.0 * (token_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size) * work.batch
    for j in range(1, steps + 1):
        kv = per_token * (work.prompt_len + j)
        kv_total += kv
        decode_s += max((weights + kv) / bytes_per_s, step_flops / flops_per_s)
    return Roofline(prefill_flops=flops, weight_bytes=weights, decode_kv_bytes=kv_total,
                    prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps)
