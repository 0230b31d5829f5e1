"""Held-out eval sets, built deterministically from a seed: five-shot arithmetic, retrieval.

Few-shot exemplars come from the train split (as GSM8K's do); the questions only from
the held-out split. Exemplars are redrawn until prompt + a worst-case answer fits the
model's context, so no prompt is silently truncated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdflow.bench.tasks.arith import fewshot_prompt, sample_problem
from pdflow.bench.tasks.corpus import train_problem
from pdflow.bench.tasks.retrieval import RetrievalSample, make_sample
from pdflow.bench.tasks.splits import is_heldout

DEPTHS = (0.01, 0.25, 0.5, 0.75, 0.99)
ANSWER_BUDGET = 320  # longest worked solution is under 300 characters


@dataclass(kw_only=True, slots=True, frozen=True)
class ArithItem:
    """A held-out question as a k-shot prompt, with its gold answer."""

    prompt: str
    question: str
    answer: int
    steps: int


def arith_eval_set(
    n: int = 500, *, k_shot: int = 5, seed: int = 1234, max_context: int = 2048
) -> list[ArithItem]:
    """`n` distinct held-out problems as k-shot prompts fitting `max_context` tokens."""
    rng = random.Random(f"arith-eval:{seed}")
    items: list[ArithItem] = []
    seen: set[str] = set()
    limit = max_context - 1 - ANSWER_BUDGET
    while len(items) < n:
        p = sample_problem(rng)
        if p.question in seen or not is_heldout(p.question):
            continue
        seen.add(p.question)
        shot_rng = random.Random(f"arith-shots:{seed}:{len(items)}")
        for _ in range(1000):
            prompt = fewshot_prompt([train_problem(shot_rng) for _ in range(k_shot)], p.question)
            if len(prompt) <= limit:
                break
        else:
            raise ValueError(f"no {k_shot}-shot prompt fits {max_context} tokens")
        items.append(ArithItem(prompt=prompt, question=p.question, answer=p.answer, steps=p.steps))
    return items


def retrieval_eval_set(
    *, context_len: int = 2048, depths: tuple[float, ...] = DEPTHS, per_depth: int = 20, seed: int = 1234
) -> list[RetrievalSample]:
    """`per_depth` held-out facts at each depth, each prompt sized to `context_len`."""
    out: list[RetrievalSample] = []
    for depth in depths:
        rng = random.Random(f"retrieval-eval:{seed}:{depth}")
        out.extend(make_sample(rng, context_len=context_len, depth=depth) for _ in range(per_depth))
    return out
