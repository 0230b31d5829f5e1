"""Messages the engine hands back: one per generated token, one per finished request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TokenOutput:
    """One generated token. ``logprob`` is under the model's unmodified distribution
    (before temperature and top-k/top-p)."""

    request_id: str
    index: int
    token_id: int
    logprob: float
    # Newly decoded text (empty when no tokenizer, or while a character is incomplete).
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    # Set when the request ended in a fault (finish_reason "error"; token_id is -1).
    error: str | None = None


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    num_cached_prompt_tokens: int = 0
    # Times the request gave its blocks back to be recomputed later.
    num_preemptions: int = 0
    # Why the request ended in a fault (finish_reason "error").
    error: str | None = None
