"""Logprobs as the OpenAI API writes them, from the engine's (token id, logprob) pairs.

Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, each ``top_logprobs`` entry a ``{token text: logprob}`` map of the k most
likely tokens plus the chosen one when it is not among them (as vLLM answers, and what
lm-eval's greedy check reads); a position without a logprob (an echoed prompt's first
token) is ``null`` in both lists. Chat (``logprobs: true, top_logprobs: k``):
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. A token's text
is its own decode; a model without a tokenizer names it ``token_id:<id>`` (vLLM's form).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TopList = list[tuple[int, float]]


@dataclass(kw_only=True, slots=True)
class LogprobRun:
    """Tokens with their logprob (None: none computed) and top list, in order."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[TopList | None] = field(default_factory=list)

    def extend(self, token_ids: list[int], logprobs: list[float | None], tops: list[TopList | None] | None) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.tops += tops if tops is not None else [None] * len(token_ids)


def prompt_run(prompt_ids: list[int], logprobs: list[float], tops: list[TopList] | None) -> LogprobRun:
    """An echoed prompt: its first token has no logprob, token i + 1 has ``logprobs[i]``."""
    run = LogprobRun()
    run.extend(prompt_ids, [None, *logprobs], [None, *tops] if tops else None)
    return run


def token_text(tokenizer, token_id: int) -> str:
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, run: LogprobRun, k: int, offset: int = 0) -> dict:
    """``offset``: where the run's first token starts in the choice's text."""
    texts = [token_text(tokenizer, t) for t in run.token_ids]
    tops, offsets = [], []
    for text, logprob, top in zip(texts, run.logprobs, run.tops, strict=True):
        offsets.append(offset)
        offset += len(text)
        if logprob is None:
            tops.append(None)
            continue
        named = {token_text(tokenizer, t): v for t, v in reversed((top or [])[:k])}  # the likelier wins a name
        named.setdefault(text, logprob)
        tops.append(dict(sorted(named.items(), key=lambda kv: -kv[1])))
    return {"tokens": texts, "token_logprobs": list(run.logprobs), "top_logprobs": tops, "text_offset": offsets}


def _entry(tokenizer, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tokenizer, run: LogprobRun, k: int) -> dict:
    return {"content": [
        _entry(tokenizer, token, logprob) | {"top_logprobs": [_entry(tokenizer, t, v) for t, v in (top or [])[:k]]}
        for token, logprob, top in zip(run.token_ids, run.logprobs, run.tops, strict=True)
    ]}
