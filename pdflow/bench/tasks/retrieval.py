"""Long-context retrieval: a key fact hidden at a depth of filler text, asked at the end.

Lengths are counted with `token_len` (default: characters, which are the shipped
tokenizer's tokens); `context_len` bounds BOS + prompt + answer + newline, so a sample
built for the model's trained context fits it exactly. Filler sentences repeat and carry
numbers of their own, so the answer is found by matching the fact, not by spotting the
only number in sight.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pdflow.bench.tasks.arith import NAMES, question_block
from pdflow.bench.tasks.splits import is_heldout

RELATIONS = ("vault code", "locker number", "door code", "badge number", "safe code")
FILLER = (
    "The river bends slowly past the old mill.",
    "Grass grows tall along the quiet road.",
    "A light wind moves through the orchard.",
    "The market opens early on most days.",
    "Clouds gather over the hills in the evening.",
    "The library keeps its windows open in summer.",
    "A small boat drifts near the harbor wall.",
    "The bakery smells of bread and cinnamon.",
    "Children play in the park after school.",
    "The train to the coast leaves at {n} each morning.",
    "There are {n} steps up to the bell tower.",
    "The old bridge was repainted {n} years ago.",
    "Room {n} at the inn faces the garden.",
    "The farm sold {n} baskets of pears last week.",
    "Snow rarely falls in the valley.",
    "The museum has a long hall of maps.",
    "Bees hum around the flowers by the fence.",
    "A narrow path climbs toward the lighthouse.",
    "The clock in the square is always on time.",
    "Fishermen mend their nets on the pier.",
    "Bus {n} stops outside the post office.",
    "The lake is calm and cold in the morning.",
    "A red kite hangs in the branches of an oak.",
    "The shop on the corner sells {n} kinds of tea.",
)
ANSWER_TAIL = 6  # " 4821" + "\n": room kept for the answer inside context_len


@dataclass(kw_only=True, slots=True, frozen=True)
class Fact:
    """One key fact: "The vault code of Mira is 4821."."""

    name: str
    relation: str
    code: str

    def sentence(self) -> str:
        return f"The {self.relation} of {self.name} is {self.code}."

    def question(self) -> str:
        return question_block(f"What is the {self.relation} of {self.name}?")


@dataclass(kw_only=True, slots=True, frozen=True)
class RetrievalSample:
    """A prompt ending in "Answer:", the expected code, and where the fact sits."""

    prompt: str
    answer: str
    depth: float
    context_len: int


def sample_fact(rng: random.Random, *, heldout: bool, exclude: frozenset[str] = frozenset()) -> Fact:
    """A fact from the requested split, for a name not in `exclude`."""
    while True:
        fact = Fact(
            name=rng.choice([n for n in NAMES if n not in exclude]),
            relation=rng.choice(RELATIONS),
            code=str(rng.randint(1000, 9999)),
        )
        if is_heldout(fact.sentence()) == heldout:
            return fact


def _filler(rng: random.Random, budget: int, token_len: Callable[[str], int]) -> list[str]:
    """Filler sentences whose " "-joined length stays within `budget`."""
    out: list[str] = []
    used = 0
    while True:
        s = rng.choice(FILLER).format(n=rng.randint(2, 999))
        cost = token_len(s) + (1 if out else 0)
        if used + cost > budget:
            return out
        out.append(s)
        used += cost


def haystack(
    rng: random.Random,
    facts: list[Fact],
    depths: list[float],
    budget: int,
    token_len: Callable[[str], int] = len,
) -> str:
    """Filler of about `budget` tokens with each fact inserted at its depth (0..1)."""
    need = sum(token_len(f.sentence()) + 1 for f in facts)
    sentences = _filler(rng, max(0, budget - need), token_len)
    ends, pos = [0], 0
    for s in sentences:
        pos += token_len(s) + 1
        ends.append(pos)
    total = max(pos, 1)
    # Insert from the deepest fact backwards so earlier indices stay valid.
    for fact, depth in sorted(zip(facts, depths, strict=True), key=lambda fd: -fd[1]):
        target = depth * total
        idx = min(range(len(ends)), key=lambda i: abs(ends[i] - target))
        sentences.insert(idx, fact.sentence())
    return " ".join(sentences)


def make_sample(
    rng: random.Random,
    *,
    context_len: int,
    depth: float,
    heldout: bool = True,
    token_len: Callable[[str], int] = len,
) -> RetrievalSample:
    """One eval sample: one fact at `depth`, question at the end, fits `context_len`."""
    fact = sample_fact(rng, heldout=heldout)
    tail = "\n" + fact.question()
    budget = context_len - 1 - token_len(tail) - ANSWER_TAIL  # 1: BOS
    text = haystack(rng, [fact], [depth], budget, token_len)
    return RetrievalSample(prompt=text + tail, answer=fact.code, depth=depth, context_len=context_len)


def training_document(
    rng: random.Random, *, context_len: int, max_facts: int = 4, token_len: Callable[[str], int] = len
) -> str:
    """A training document: 1..max_facts train-split facts, every one asked and answered.

    Several facts per document multiply the answer signal and act as distractors for
    one another. The caller adds BOS and EOS (counted in `context_len`).
    """
    n = rng.randint(1, max_facts)
    facts: list[Fact] = []
    for _ in range(n):
        facts.append(sample_fact(rng, heldout=False, exclude=frozenset(f.name for f in facts)))
    asks = facts[:]
    rng.shuffle(asks)
    qa = "".join(f"\n{f.question()} {f.code}" for f in asks)
    budget = context_len - 2 - token_len(qa)
    depths = [rng.random() for _ in facts]
    return haystack(rng, facts, depths, budget, token_len) + qa
