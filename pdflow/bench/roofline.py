"""The fastest a batched greedy run could go on a device: the yardstick of the engine bench.

Prefill is priced as compute (its matmul and causal attention FLOPs at a measured GEMM
rate), each decode step as memory traffic (every weight and every live KV byte read once
at a measured HBM rate), each phase taking whichever bound is larger. Only the sampled
rows pay for the LM head (one per sequence at prefill, as the engine computes logits).
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


def layer_matmul_params(cfg: DecoderConfig) -> int:
    """Weights one token multiplies through in one decoder layer (qkv, o, gate_up, down)."""
    d, h, hkv, hid = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    return hid * (h + 2 * hkv) * d + h * d * hid + 3 * hid * cfg.intermediate_size


def weight_bytes(cfg: DecoderConfig, dtype_bytes: int) -> int:
    """Bytes a decode step reads: every layer's matmuls and norms, the final norm and the
    LM head (the embedding is only gathered: a few rows, unless tied to the head)."""
    per_layer = layer_matmul_params(cfg) + 2 * cfg.hidden_size
    if cfg.architecture == "Qwen3ForCausalLM":
        per_layer += 2 * cfg.head_dim
    head = cfg.vocab_size * cfg.hidden_size
    return (cfg.num_layers * per_layer + cfg.hidden_size + head) * dtype_bytes


def kv_bytes_per_token(cfg: DecoderConfig, kv_dtype_bytes: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes


def prefill_flops(cfg: DecoderConfig, batch: int, prompt_len: int) -> float:
    """Matmuls over every prompt token, causal attention (QK and PV, 2 FLOPs a MAC, each
    query over the positions up to its own), one LM-head row per sequence."""
    tokens = batch * prompt_len
    linear = 2.0 * layer_matmul_params(cfg) * cfg.num_layers * tokens
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
    weights = weight_bytes(cfg, work.dtype_bytes)
    flops = prefill_flops(cfg, work.batch, work.prompt_len)
    prefill_s = max(flops / flops_per_s, weights / bytes_per_s)
    steps = max(0, work.output_len - 1)
    per_token = kv_bytes_per_token(cfg, kv_bytes) * work.batch
    decode_s, kv_total = 0.0, 0.0
    step_flops = 2.0 * (layer_matmul_params(cfg) * cfg.num_layers
                        + cfg.vocab_size * cfg.hidden_size) * work.batch
    for j in range(1, steps + 1):
        kv = per_token * (work.prompt_len + j)
        kv_total += kv
        decode_s += max((weights + kv) / bytes_per_s, step_flops / flops_per_s)
    return Roofline(prefill_flops=flops, weight_bytes=weights, decode_kv_bytes=kv_total,
                    prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps)
