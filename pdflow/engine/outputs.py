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
    # Speculative decoding, the request's counts so far: drafts offered to the target,
    # drafts it accepted, and decode forwards that verified them.
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    # P/D producer: the prompt's first token, reported once its KV transfer settled (it
    # landed unless ``kv_error`` says why not).
    kv_settled: bool = False
    kv_error: str | None = None
    # SamplingParams.logprobs: the k most likely tokens at this position (token id,
    # logprob), most likely first; None when the request did not ask.
    top_logprobs: list[tuple[int, float]] | None = None
    # On a request's first token only. SamplingParams.prompt_logprobs: the logprob of
    # prompt tokens 1.. (the first has none) and each position's top k; prompt tokens
    # served from the prefix cache (what usage.prompt_tokens_details.cached_tokens says).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0


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
    # Speculative decoding: drafts offered, drafts accepted (<= drafted), and the decode
    # forwards that verified them; tokens per forward = (accepted + steps) / steps.
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    # SamplingParams.logprobs / prompt_logprobs (see TokenOutput); None when not asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        steps = self.num_verify_steps
        return (self.num_accepted + steps) / steps if steps else 0.0
