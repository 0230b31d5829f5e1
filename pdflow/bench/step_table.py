"""The model step table: seconds of pdflow's own decoder layer, LM head and sampling on
one device, per TP shard and torch thread count, at a few token counts.

Why: a GEMM rate prices only a step's matmuls; a small model's step is mostly the rest
(norms, RoPE, the attention backend, sampling, each op's fixed cost), and it is what the
engine runs. ``pdflow profile`` times the model code itself (``step_timing``, as Vidur
profiles operators) and the estimate reads this table between the measured points.
Torch-free: the estimate and the profile file only need the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class ShardTimes:
    """One rank's layer: heads and MLP split ``tp`` ways, run with ``threads`` torch
    threads (what a rank gets when the deployment's ranks share the cores). Seconds."""

    tp: int
    threads: int
    # tokens of a step -> one layer less its attention op (norms, projections, RoPE, MLP)
    dense_s: dict[int, float]
    # prompt tokens of one sequence (from position 0) -> the attention op (KV store included)
    prefill_attention_s: dict[int, float]
    # context length -> decode batch -> one layer's forward (one new token per sequence)
    decode_s: dict[int, dict[int, float]]
    # rows -> final norm, LM head and greedy sampling of that many rows
    head_s: dict[int, float]

    def layer_s(self, tokens: int, rows: int, context: int) -> float:
        """One layer's forward for a step of ``tokens`` new tokens over ``rows`` sequences
        at mean ``context``: the decode table when every row brings one token (or a few
        drafted ones); otherwise the dense part at ``tokens`` plus each row's attention
        over its share of them (rows of a prefill step attend each to its own prompt)."""
        if tokens <= rows * 8 and self.decode_s:  # decode, or verifying a few drafts a row
            return decode_at(self.decode_s, tokens, context)
        rows = max(1, rows)
        return interpolate(self.dense_s, tokens) + rows * interpolate(self.prefill_attention_s, tokens / rows)


@dataclass(kw_only=True, slots=True)
class StepTable:
    """A model's step times on this device (``geometry``: what they depend on)."""

    model: str
    geometry: dict[str, int | str]
    shards: list[ShardTimes]

    def shard(self, tp: int, threads: int) -> ShardTimes | None:
        """The shard of ``tp`` timed with ``threads`` threads (on a GPU: any thread count)."""
        found = [s for s in self.shards if s.tp == tp]
        if self.geometry.get("device") == "cpu":
            found = [s for s in found if s.threads == threads]
        return found[0] if found else None

    @classmethod
    def from_dict(cls, raw: dict) -> StepTable:
        """From the profile's JSON (whose keys are strings)."""
        shards = [ShardTimes(
            tp=int(s["tp"]), threads=int(s["threads"]),
            dense_s={int(k): float(v) for k, v in s["dense_s"].items()},
            prefill_attention_s={int(k): float(v) for k, v in s["prefill_attention_s"].items()},
            decode_s={int(c): {int(b): float(v) for b, v in row.items()} for c, row in s["decode_s"].items()},
            head_s={int(k): float(v) for k, v in s["head_s"].items()},
        ) for s in raw["shards"]]
        return cls(model=raw["model"], geometry=dict(raw["geometry"]), shards=shards)


def geometry_of(model, device: str) -> dict[str, int | str]:
    """What a layer's time depends on, from a ``ModelSpec``: a table prices a model only
    when this matches (another model of the same shape is the same work)."""
    return {"device": "cpu" if device == "cpu" else "cuda", "architecture": model.architecture,
            "hidden": model.hidden, "heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
            "intermediate": model.intermediate, "vocab": model.vocab, "dtype": model.dtype,
            "weight_dtype": model.stored_weight_dtype, "experts": model.experts}


def interpolate(points: dict[int, float], x: float) -> float:
    """Seconds at ``x`` from measured ``{x_i: seconds}``: log-log between the two points
    around ``x``; below the smallest point, its time (a call's fixed cost is the floor);
    above the largest, its time scaled by ``x / largest`` (work grows with the tokens)."""
    if not points:
        raise ValueError("no measured points to interpolate")
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]] * x / xs[-1]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    x0, x1 = xs[hi - 1], xs[hi]
    y0, y1 = points[x0], points[x1]
    if y0 <= 0 or y1 <= 0:
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    w = math.log(x / x0) / math.log(x1 / x0)
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


def decode_at(by_context: dict[int, dict[int, float]], batch: int, context: int) -> float:
    """A decode layer's seconds at ``batch`` and ``context``: by batch (``interpolate``)
    at each measured context, then linear in the context between them (attention reads
    grow linearly with it); below the shortest, the shortest's; above the longest, the
    line through the two longest, extended."""
    contexts = sorted(by_context)
    at = {c: interpolate(by_context[c], batch) for c in contexts}
    if len(contexts) == 1 or context <= contexts[0]:
        return at[contexts[0]]
    if context >= contexts[-1]:
        c0, c1 = contexts[-2], contexts[-1]
    else:
        hi = next(i for i, c in enumerate(contexts) if c >= context)
        c0, c1 = contexts[hi - 1], contexts[hi]
    value = at[c0] + (at[c1] - at[c0]) * (context - c0) / (c1 - c0)
    return max(value, at[c1]) if context > c1 else value  # a noisy falling pair: no lower
