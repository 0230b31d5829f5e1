"""Logprobs a request asked for, computed on the last stage from the step's own logits.

Only when a request asks (``StepInput.top_logprobs``, ``StepInput.prompt_logprobs``): the
default step computes nothing here. Values are under the model's unmodified distribution
(log_softmax of the logits, before temperature and top-k/top-p), like a sampled token's.
Prompt rows are scored from this forward's hidden states of the prompt positions, so a
chunked prefill scores each chunk as it runs; every TP rank of the last stage calls
``score_prompts`` (the logits' vocab all-gather needs them all), the first answers.
"""

from __future__ import annotations

import torch

from pdflow.parallel.messages import PromptLogprobs, StepInput, TopLogprobs

_NONE = TopLogprobs(token_ids=[], logprobs=[])


def top_of(logprobs: torch.Tensor, ks: list[int]) -> list[TopLogprobs]:
    """Per row of ``logprobs`` [R, V], its ``ks[r]`` most likely tokens (none when < 1)."""
    widest = min(max(ks, default=0), logprobs.shape[-1])
    if widest < 1:
        return [_NONE] * len(ks)
    values, ids = torch.topk(logprobs, widest, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TopLogprobs(token_ids=ids[r][:k], logprobs=values[r][:k]) if k > 0 else _NONE
            for r, k in enumerate(ks)]


def sampled_top(step: StepInput, logits: torch.Tensor, counts: list[int] | None = None) -> list[TopLogprobs]:
    """Top logprobs of every emitted token: ``logits`` [T, V] holds one row per emitted
    token, ``counts`` how many each sampled row emitted (one each without drafts)."""
    if not step.top_logprobs:
        return []
    counts = counts or [1] * len(step.top_logprobs)
    ks = [k for k, n in zip(step.top_logprobs, counts, strict=True) for _ in range(n)]
    return top_of(torch.log_softmax(logits.float(), dim=-1), ks)


def score_prompts(step: StepInput, hidden: torch.Tensor, compute_logits) -> list[PromptLogprobs]:
    """The logprob of each asked-for prompt row's next prompt token, and its top k."""
    if not step.prompt_logprobs:
        return []
    rows = [r.first_row + i for r in step.prompt_logprobs for i in range(len(r.targets))]
    device = hidden.device
    logprobs = torch.log_softmax(
        compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)]).float(), dim=-1)
    targets = torch.tensor([t for r in step.prompt_logprobs for t in r.targets], dtype=torch.int64, device=device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    ks = [r.top for r in step.prompt_logprobs for _ in r.targets]
    tops = top_of(logprobs, ks)
    out, at = [], 0
    for r in step.prompt_logprobs:
        n = len(r.targets)
        out.append(PromptLogprobs(request_id=r.request_id, logprobs=chosen[at:at + n],
                                  top=tops[at:at + n] if r.top > 0 else []))
        at += n
    return out
