"""Per-row sampling rules for speculative decoding, vectorised over rows.

The filtering (temperature, then top-k, then top-p, renormalised) is the target
sampler's rule (``pdflow.worker.sampler.sampling_probs``) applied to many rows at once
with per-row settings: verification must accept against exactly the distribution the
target would sample from, or the output distribution shifts. Tests check the two agree.
Random draws come from each request's own generator (seeded requests) so a row's
tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class SamplingBatch:
    """Per-row sampling settings: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    # One per row: that request's generator, or None (the shared default stream).
    generators: list[torch.Generator | None]

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        n = len(temperature)
        return cls(
            temperature=torch.tensor(list(temperature), dtype=torch.float32, device=device),
            top_k=torch.tensor(list(top_k) if top_k is not None else [0] * n, dtype=torch.int64, device=device),
            top_p=torch.tensor(list(top_p) if top_p is not None else [1.0] * n, dtype=torch.float32, device=device),
            generators=list(generators) if generators is not None else [None] * n,
        )

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool: rows that take the argmax."""
        return self.temperature == 0

    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    def rows(self, index: torch.Tensor) -> SamplingBatch:
        """The settings of a subset of rows (``index`` [R] int64)."""
        host = index.tolist()
        return SamplingBatch(
            temperature=self.temperature[index], top_k=self.top_k[index], top_p=self.top_p[index],
            generators=[self.generators[i] for i in host],
        )


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The distribution each row samples from: logits [R, V] with per-row settings [R]
    (temperature > 0). Same rule as the target sampler's ``sampling_probs``."""
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature.float()[:, None]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if not bool(k_on.any() | p_on.any()):
        return torch.softmax(scaled, dim=-1)
    sorted_vals, order = scaled.sort(dim=-1, descending=True)
    if bool(k_on.any()):
        k_eff = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
        kth = sorted_vals.gather(1, (k_eff - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool(p_on.any()):
        sorted_probs = probs.gather(1, order)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = (mass_before >= top_p.float()[:, None]) & p_on[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        renormed = probs / probs.sum(-1, keepdim=True)
        probs = torch.where(p_on[:, None], renormed, probs)
    return probs


def uniforms(
    generators: Sequence[torch.Generator | None], count: int, device: torch.device,
    default: torch.Generator | None = None,
) -> torch.Tensor:
    """[R, count] float64 uniforms in [0, 1): row r from ``generators[r]`` (or ``default``).
    Every row draws exactly ``count`` numbers, so a seeded stream advances the same way
    whatever the batch."""
    rows = len(generators)
    if all(g is None for g in generators):
        return torch.rand((rows, count), generator=default, dtype=torch.float64, device=device)
    out = torch.empty((rows, count), dtype=torch.float64, device=device)
    for r, gen in enumerate(generators):
        out[r] = torch.rand(count, generator=gen if gen is not None else default, dtype=torch.float64,
                            device=device)
    return out


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: row r of ``probs`` [R, V] (unnormalised is fine) at uniform
    ``u[r]``. A token of zero mass is never picked."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, u.double()[:, None] * total, right=True)[:, 0]
    # u * total can round up to total: fall back to the last token with mass.
    last = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(picked, last)


def draft_tokens(
    logits: torch.Tensor, sampling: SamplingBatch | None, default: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from draft logits [B, K, V]: the argmax for greedy rows; for sampled rows a
    draw from the filtered draft distribution, which is returned as q [B, K, V] (one-hot
    for greedy rows) so verification can accept with min(1, p/q). q is None when every
    row is greedy."""
    greedy = logits.argmax(-1)
    if sampling is None or sampling.all_greedy():
        return greedy, None
    b, k, v = logits.shape
    q = torch.nn.functional.one_hot(greedy, v).to(torch.float32)
    rows = (~sampling.greedy).nonzero()[:, 0]
    sub = sampling.rows(rows)
    flat = logits[rows].reshape(-1, v)
    per_pos = lambda t: t.repeat_interleave(k)
    probs = filtered_probs(flat, per_pos(sub.temperature), per_pos(sub.top_k), per_pos(sub.top_p))
    u = uniforms(sub.generators, k, logits.device, default).reshape(-1)
    tokens = greedy.clone()
    tokens[rows] = sample_with(probs, u).view(-1, k)
    q[rows] = probs.view(-1, k, v)
    return tokens, q
