"""Write the arithmetic multiple-choice task lm-eval scores by loglikelihood
(``pdflow/bench/tasks/lm_eval/arith_mc.{jsonl,yaml}``), from the shipped model's tasks.

Each doc: one solved train-split example and a held-out problem whose worked solution is
given up to its final ``####``; the choices are the answer and three distractors (the
solution's intermediate results first, then the answer +- 1, +- 10). Deterministic: the
same file for the same arguments. ``python scripts/make_arith_mc.py [--docs 32]``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from pdflow.bench.tasks.arith import fewshot_prompt, sample_problem
from pdflow.bench.tasks.corpus import train_problem
from pdflow.bench.tasks.splits import is_heldout

OUT = Path(__file__).resolve().parents[1] / "pdflow" / "bench" / "tasks" / "lm_eval" / "arith_mc.jsonl"
CHOICES = 4


def distractors(solution: str, answer: int, rng: random.Random) -> list[int]:
    """Numbers a reader could confuse with the answer: the solution's other results."""
    results = [int(x) for x in re.findall(r"= (\d+)", solution)]
    near = [answer + 1, answer - 1, answer + 10, answer - 10]
    out: list[int] = []
    for x in [*dict.fromkeys(results), *near]:
        if x != answer and x >= 0 and x not in out:
            out.append(x)
    return out[: CHOICES - 1]


def make_docs(n: int, seed: int) -> list[dict]:
    rng = random.Random(f"arith-mc:{seed}")
    docs, seen = [], set()
    while len(docs) < n:
        p = sample_problem(rng)
        if p.question in seen or not is_heldout(p.question):
            continue
        seen.add(p.question)
        worked, _, _ = p.solution.rpartition("####")
        context = fewshot_prompt([train_problem(rng)], p.question) + " " + worked + "####"
        choices = [p.answer, *distractors(p.solution, p.answer, rng)]
        rng.shuffle(choices)
        docs.append({"context": context, "choices": [f" {c}" for c in choices], "label": choices.index(p.answer)})
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with OUT.open("w") as f:
        for doc in make_docs(args.docs, args.seed):
            f.write(json.dumps(doc) + "\n")
    print(f"wrote {args.docs} docs to {OUT}")


if __name__ == "__main__":
    main()
