"""Training documents for the shipped model, drawn from the train split only.

An arithmetic document is solved examples in the exact few-shot layout, packed until the
next would not fit; a retrieval document is a haystack with its questions answered. A
training row is BOS + document (+ EOS for retrieval), so eval prompts (BOS + shots +
question) look like training positions 0..n.
"""

from __future__ import annotations

import random

from pdflow.bench.tasks.arith import ArithProblem, sample_problem
from pdflow.bench.tasks.retrieval import training_document
from pdflow.bench.tasks.splits import is_heldout


def train_problem(rng: random.Random) -> ArithProblem:
    """A problem from the train split (held-out questions are redrawn)."""
    while True:
        p = sample_problem(rng)
        if not is_heldout(p.question):
            return p


def arith_document(rng: random.Random, max_chars: int) -> str:
    """Solved train-split examples joined by blank lines, at most `max_chars` long."""
    parts: list[str] = []
    used = 0
    while True:
        text = train_problem(rng).example() + "\n\n"
        if used + len(text) > max_chars:
            if not parts:  # a tiny smoke context: cut one example rather than return nothing
                parts.append(text[:max_chars])
            return "".join(parts)
        parts.append(text)
        used += len(text)


def retrieval_document(rng: random.Random, seq_len: int, *, min_len: int = 128) -> str:
    """A retrieval document; half use the whole context, half a uniform shorter one."""
    full = rng.random() < 0.5 or seq_len <= min_len
    context = seq_len if full else rng.randint(min_len, seq_len)
    max_facts = max(1, min(4, context // 200))
    return training_document(rng, context_len=context, max_facts=max_facts)


def training_text(rng: random.Random, seq_len: int, *, retrieval_fraction: float = 0.35) -> tuple[str, bool]:
    """One document for a row of `seq_len` tokens; True when it should end with EOS."""
    if rng.random() < retrieval_fraction:
        return retrieval_document(rng, seq_len), True
    return arith_document(rng, seq_len - 1), False
