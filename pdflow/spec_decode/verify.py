"""Verification: the target scored k+1 positions in one forward; decide what to emit.

Greedy rows accept the longest prefix of drafts equal to the target's argmaxes and emit
it plus one bonus token (the target's argmax after it). Sampled rows run standard
speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``x`` drawn from
q is accepted with probability min(1, p(x)/q(x)); at the first rejection a token is
drawn from norm(max(0, p - q)); when every draft is accepted a bonus is drawn from p.
The emitted tokens are then distributed exactly as if the target had sampled them one
at a time from p (its filtered distribution, the sampler's own rule). Everything is
batched, with a per-row number of drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdflow.spec_decode.sampling import SamplingBatch, filtered_probs, sample_with, uniforms


@dataclass(kw_only=True, slots=True)
class VerifyResult:
    num_drafts: torch.Tensor  # [B] int64: drafts each row offered
    num_accepted: torch.Tensor  # [B] int64: drafts accepted (<= num_drafts)
    # [B, K+1] int64: emitted tokens (accepted drafts then the bonus/correction), -1 after.
    tokens: torch.Tensor
    # [B, K+1] float32: each emitted token's log-probability under the raw target logits.
    logprobs: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1

    def emitted(self) -> list[list[int]]:
        """Per row, the tokens to append (one host transfer)."""
        counts = self.num_emitted.tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), counts, strict=True)]


def padded_rows(flat: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Logits of a verify forward's scored rows, request after request (num_drafts[b] + 1
    rows each, [sum, V]), as [B, K+1, V] for ``verify`` (padding repeats a request's last row)."""
    counts = num_drafts.to(torch.int64) + 1
    k1 = int(counts.max()) if counts.numel() else 1
    starts = torch.cumsum(counts, 0) - counts
    offset = torch.arange(k1, device=flat.device)
    index = starts[:, None] + torch.minimum(offset[None, :], counts[:, None] - 1)
    return flat[index.to(flat.device)]


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    num_drafts: torch.Tensor | None = None,
    sampling: SamplingBatch | None = None,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """target_logits [B, K+1, V] (row b's position i scores the token after draft i-1;
    positions past ``num_drafts[b]`` are ignored), draft_tokens [B, K], num_drafts [B]
    (default K). ``draft_probs`` [B, K, V] is the distribution each draft was drawn from;
    None means deterministic drafts (q is one-hot). ``sampling`` None: every row greedy.
    ``generator`` serves rows without a generator of their own."""
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    if draft_tokens.shape != (b, k):
        raise ValueError(f"draft_tokens {tuple(draft_tokens.shape)} must be {(b, k)} for logits "
                         f"{tuple(target_logits.shape)}")
    if num_drafts is None:
        num_drafts = torch.full((b,), k, dtype=torch.int64, device=device)
    num_drafts = num_drafts.to(device=device, dtype=torch.int64)
    pos = torch.arange(k, device=device)
    offered = pos[None, :] < num_drafts[:, None]
    # Slots past a row's drafts may hold padding (e.g. -1): never read them as tokens.
    drafts = torch.where(offered, draft_tokens.to(torch.int64), 0)

    argmax = target_logits.argmax(-1)
    match = (drafts == argmax[:, :k]) & offered
    final = argmax.gather(1, _accepted_count(match)[:, None])[:, 0]

    if sampling is not None and not sampling.all_greedy():
        rows = (~sampling.greedy).nonzero()[:, 0]
        sub = sampling.rows(rows)
        s_match, s_final = _speculative_sample(
            target_logits[rows], drafts[rows], num_drafts[rows], offered[rows], sub,
            None if draft_probs is None else draft_probs[rows], generator,
        )
        match[rows] = s_match
        final[rows] = s_final

    accepted = _accepted_count(match)
    tokens = torch.where(pos[None, :] < accepted[:, None], drafts, torch.full_like(drafts, -1))
    tokens = torch.cat([tokens, tokens.new_full((b, 1), -1)], dim=1)
    tokens.scatter_(1, accepted[:, None], final[:, None])
    logprobs = torch.log_softmax(target_logits.float(), dim=-1).gather(2, tokens.clamp(min=0)[..., None])[..., 0]
    logprobs = logprobs.masked_fill(tokens < 0, 0.0)
    return VerifyResult(num_drafts=num_drafts, num_accepted=accepted, tokens=tokens, logprobs=logprobs)


def _accepted_count(match: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``match`` [B, K]."""
    return match.long().cumprod(dim=1).sum(dim=1)


def _accept(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p(x)/q(x)): u < p/q, written without dividing."""
    return u * q_x < p_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejection redraws from: max(0, p - q) (unnormalised; the draw normalises)."""
    return (p - q).clamp(min=0)


def _speculative_sample(
    logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, offered: torch.Tensor,
    sampling: SamplingBatch, q: torch.Tensor | None, generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance mask [R, K] and the final token [R] of rows that sample."""
    r, k1, vocab = logits.shape
    k = k1 - 1
    per_pos = lambda t: t.repeat_interleave(k1)
    p = filtered_probs(
        logits.reshape(-1, vocab), per_pos(sampling.temperature), per_pos(sampling.top_k),
        per_pos(sampling.top_p),
    ).view(r, k1, vocab)
    u = uniforms(sampling.generators, k1, logits.device, generator)
    p_x = p[:, :k].gather(2, drafts[..., None])[..., 0].double()
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, drafts[..., None])[..., 0].double()
    match = _accept(p_x, q_x, u[:, :k]) & offered

    at = _accepted_count(match)
    rejected = at < num_drafts
    p_at = p.gather(1, at[:, None, None].expand(r, 1, vocab))[:, 0]
    if k == 0:
        return match, sample_with(p_at, u[:, k])
    last = at.clamp(max=k - 1)
    if q is None:
        q_at = torch.nn.functional.one_hot(drafts.gather(1, last[:, None])[:, 0], vocab)
    else:
        q_at = q.gather(1, last[:, None, None].expand(r, 1, vocab))[:, 0]
    residual = _residual(p_at, q_at.to(p_at.dtype))
    # p == q makes a rejection impossible; if rounding produced one, p is the exact answer.
    usable = rejected & (residual.sum(-1) > 0)
    dist = torch.where(usable[:, None], residual, p_at)
    return match, sample_with(dist, u[:, k])
