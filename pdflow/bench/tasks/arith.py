"""Multi-step arithmetic word problems in GSM8K's shape, sized for a tiny model to learn.

Every step is one binary operation written out in full ("Mira has 12 + 7 = 19 apples."),
operands stay small (start values <= 60, multipliers 2-6, results <= 999), so what the
model must learn is reading the problem and per-step arithmetic, not hidden carries.
A worked solution ends with "#### <answer>", as GSM8K's do.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

NAMES = (
    "Mira", "Tom", "Ava", "Leo", "Nina", "Omar", "Zoe", "Ivan", "Lena", "Ravi", "Sara", "Ben",
    "Kai", "Emma", "Noah", "Lily", "Hugo", "Ines", "Jack", "Maya", "Yuki", "Paul", "Rosa",
    "Sam", "Tara", "Alex", "Dina", "Felix", "Gwen", "Hana", "Igor", "June", "Karl", "Lucy",
    "Marco", "Nora", "Owen", "Pia", "Quinn", "Rita",
)
ITEMS = (
    "apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards",
    "books", "coins", "buttons", "candles", "lemons", "eggs", "beads", "balloons", "rocks",
    "plums", "toy cars", "pebbles", "crayons", "oranges", "muffins", "ribbons", "tickets",
    "feathers", "seeds", "postcards", "bottle caps", "paper cranes",
)
CONTAINERS = ("boxes", "bags", "packs", "jars", "crates", "baskets")
GOODS = ("notebooks", "pens", "tickets", "books", "toys", "cups", "hats", "plants")
MAX_VALUE = 999


@dataclass(kw_only=True, slots=True, frozen=True)
class ArithProblem:
    """One problem: question text, worked solution (ending "#### N"), integer answer."""

    question: str
    solution: str
    answer: int
    steps: int

    def example(self) -> str:
        """The solved example as it appears in few-shot prompts and training documents."""
        return f"Question: {self.question}\nAnswer: {self.solution}"


def question_block(question: str) -> str:
    """The unsolved tail of a prompt; the model continues with " <solution>"."""
    return f"Question: {question}\nAnswer:"


def fewshot_prompt(shots: list[ArithProblem], question: str) -> str:
    """k solved examples, blank-line separated, then the question (lm-eval GSM8K layout)."""
    return "".join(s.example() + "\n\n" for s in shots) + question_block(question)


class _Draft:
    """Accumulates question sentences and solution lines while the problem is built."""

    def __init__(self) -> None:
        self.question: list[str] = []
        self.lines: list[str] = []
        self.steps = 0

    def step(self, a: int, op: str, b: int) -> int:
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
        self.steps += 1
        return value

    def has(self, who: str, a: int, op: str, b: int, unit: str) -> int:
        """One step written as "<who> has a <op> b = <value> <unit>."; returns the value."""
        value = self.step(a, op, b)
        self.lines.append(f"{who} has {a} {op} {b} = {value} {unit}.")
        return value

    def done(self, ask: str, answer: int) -> ArithProblem:
        solution = "\n".join([*self.lines, f"#### {answer}"])
        question = " ".join([*self.question, ask])
        return ArithProblem(question=question, solution=solution, answer=answer, steps=self.steps)


def _chain(rng: random.Random, n_steps: int) -> ArithProblem:
    """One person's count changes step by step; ask for the final count."""
    p, q = rng.sample(NAMES, 2)
    money = rng.random() < 0.2
    unit = "dollars" if money else rng.choice(ITEMS)
    x = rng.randint(20, 99) if money else rng.randint(5, 60)
    d = _Draft()
    d.question.append(f"{p} has {x} {unit}.")
    while d.steps < n_steps:
        left = n_steps - d.steps
        ops = ["add", "sub"]
        if x <= 99:
            ops.append("mul")
        if any(x % k == 0 for k in range(2, 6)) and x >= 4:
            ops.append("div")
        if left >= 2:
            ops.append("buy" if money else "packs")
        op = rng.choice(ops)
        if op == "add":
            b = rng.randint(2, min(40, MAX_VALUE - x))
            verbs = (
                (f"{p} earns {b} more dollars.", f"{q} gives {p} {b} dollars.")
                if money
                else (f"{p} finds {b} more {unit}.", f"{q} gives {p} {b} {unit}.",
                      f"{p} buys {b} more {unit}.", f"{p} gets {b} more {unit} from {q}.")
            )
            d.question.append(rng.choice(verbs))
            y = d.has(p, x, "+", b, unit)
        elif op == "sub" and x >= 3:
            b = rng.randint(1, min(40, x - 1))
            verbs = (
                (f"{p} spends {b} dollars.", f"{p} pays {q} {b} dollars.")
                if money
                else (f"{p} gives {b} {unit} to {q}.", f"{p} loses {b} {unit}.",
                      f"{p} sells {b} {unit}.", f"{p} uses {b} {unit}.")
            )
            d.question.append(rng.choice(verbs))
            y = d.has(p, x, "-", b, unit)
        elif op == "mul":
            k = rng.randint(2, 5) if x <= 60 else rng.randint(2, 3)
            named = {2: "doubles", 3: "triples"}
            if k in named and rng.random() < 0.5:
                d.question.append(f"The number of {unit} {p} has {named[k]}.")
            else:
                d.question.append(f"{p} ends up with {k} times as many {unit} as before.")
            y = d.has(p, x, "*", k, unit)
        elif op == "div":
            k = rng.choice([k for k in range(2, 6) if x % k == 0])
            d.question.append(f"{p} splits the {unit} into {k} equal parts and keeps one part.")
            y = d.step(x, "/", k)
            d.lines.append(f"{p} keeps {x} / {k} = {y} {unit}.")
        elif op == "buy" and x >= 8:
            n = rng.randint(2, min(12, x // 2))
            k = rng.randint(2, max(2, min(6, x // n)))
            if k * n >= x:
                continue
            good = rng.choice(GOODS)
            d.question.append(f"{p} buys {k} {good} for {n} dollars each.")
            m = d.step(k, "*", n)
            d.lines.append(f"The {good} cost {k} * {n} = {m} dollars.")
            y = d.has(p, x, "-", m, "dollars")
        elif op == "packs":
            k, n = rng.randint(2, 6), rng.randint(2, 12)
            if x + k * n > MAX_VALUE:
                continue
            box = rng.choice(CONTAINERS)
            d.question.append(f"{p} buys {k} {box} of {unit} with {n} {unit} in each.")
            m = d.step(k, "*", n)
            d.lines.append(f"{p} buys {k} * {n} = {m} {unit}.")
            y = d.has(p, x, "+", m, unit)
        else:
            continue
        x = y
    ask = rng.choice((f"How many {unit} does {p} have now?", f"How many {unit} does {p} have at the end?"))
    return d.done(ask, x)


def _relate(rng: random.Random, d: _Draft, who: str, base_name: str, base: int, unit: str) -> int:
    """`who` has some relation to `base_name`'s count; one step; returns who's count."""
    kinds = ["more", "fewer"] if base > 2 else ["more"]
    if base <= 60:
        kinds.append("times")
    kind = rng.choice(kinds)
    if kind == "more":
        b = rng.randint(2, 40)
        d.question.append(f"{who} has {b} more {unit} than {base_name}.")
        value = d.has(who, base, "+", b, unit)
    elif kind == "fewer":
        b = rng.randint(1, min(40, base - 1))
        d.question.append(f"{who} has {b} fewer {unit} than {base_name}.")
        value = d.has(who, base, "-", b, unit)
    else:
        k = rng.randint(2, 4)
        d.question.append(f"{who} has {k} times as many {unit} as {base_name}.")
        value = d.has(who, base, "*", k, unit)
    return value


def _group(rng: random.Random, n_steps: int) -> ArithProblem:
    """Two or three people related to each other; ask for one count or a total."""
    p, q, r = rng.sample(NAMES, 3)
    unit = rng.choice(ITEMS)
    a = rng.randint(5, 60)
    d = _Draft()
    d.question.append(f"{p} has {a} {unit}.")
    c = _relate(rng, d, q, p, a, unit)
    if n_steps == 2 and rng.random() < 0.5:
        s = d.step(a, "+", c)
        d.lines.append(f"{p} and {q} have {a} + {c} = {s} {unit} together.")
        return d.done(f"How many {unit} do {p} and {q} have together?", s)
    e = _relate(rng, d, r, q, c, unit)
    if n_steps == 2:
        return d.done(f"How many {unit} does {r} have?", e)
    s = d.step(c, "+", e)
    d.lines.append(f"{q} and {r} have {c} + {e} = {s} {unit} together.")
    if n_steps == 3:
        return d.done(f"How many {unit} do {q} and {r} have together?", s)
    t = d.step(s, "+", a)
    d.lines.append(f"With {p}, they have {s} + {a} = {t} {unit} in total.")
    return d.done(f"How many {unit} do {p}, {q} and {r} have in total?", t)


FAMILIES: tuple[Callable[[random.Random, int], ArithProblem], ...] = (_chain, _group)


def sample_problem(rng: random.Random, *, min_steps: int = 2, max_steps: int = 4) -> ArithProblem:
    """Draw one problem with `min_steps`..`max_steps` arithmetic steps."""
    n_steps = rng.randint(min_steps, max_steps)
    return rng.choice(FAMILIES)(rng, n_steps)
