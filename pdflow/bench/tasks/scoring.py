"""Scoring as lm-eval scores GSM8K (strict "####" and flexible last-number) plus retrieval.

Shared by scripts/eval_target.py (transformers) and the engine's own eval, so the two
report numbers that mean the same thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What ends a generation: lm-eval's GSM8K "until" list ("Question:") plus the blank line
# that separates few-shot examples.
ARITH_STOPS = ("\n\n", "Question:")
RETRIEVAL_STOPS = ("\n",)

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def truncate(text: str, stops: tuple[str, ...] = ARITH_STOPS) -> str:
    """`text` up to the earliest stop sequence."""
    cut = len(text)
    for stop in stops:
        i = text.find(stop)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def _normalize(number: str) -> str:
    """lm-eval's regexes_to_ignore for GSM8K: commas, "$", a trailing period."""
    return re.sub(r"\.$", "", number.replace(",", "").replace("$", "")).strip()


def extract_strict(text: str) -> str | None:
    """The number on the first "#### N" line, or None."""
    m = _STRICT.search(text)
    return _normalize(m.group(1)) if m else None


def extract_flexible(text: str) -> str | None:
    """The last number anywhere in the output, or None."""
    matches = _FLEXIBLE.findall(text)
    if not matches:
        return None
    first, second = matches[-1]
    return _normalize(first or second)


@dataclass(kw_only=True, slots=True, frozen=True)
class ArithScore:
    """Exact match of one output under both extraction rules."""

    strict: bool
    flexible: bool


def score_arith(output: str, answer: int | str, *, stops: tuple[str, ...] = ARITH_STOPS) -> ArithScore:
    """Score a raw generation (truncated at `stops` first) against the gold answer."""
    text = truncate(output, stops)
    gold = _normalize(str(answer))
    return ArithScore(strict=extract_strict(text) == gold, flexible=extract_flexible(text) == gold)


def score_retrieval(output: str, answer: str) -> bool:
    """Exact match of the first line of the output (a trailing period allowed)."""
    return _normalize(truncate(output, RETRIEVAL_STOPS)) == answer


def mean(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0
