"""Arithmetic generator: determinism, worked steps that check out, bounded numbers."""

import random
import re

import pytest

from pdflow.bench.tasks import arith_eval_set, fewshot_prompt, sample_problem, train_problem
from pdflow.bench.tasks.vocab import CHARS

STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _problems(seed, n):
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def test_same_seed_same_problems_other_seed_differs():
    assert _problems(7, 50) == _problems(7, 50)
    assert _problems(7, 50) != _problems(8, 50)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_step_is_explicit_and_correct(seed):
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}
    for p in _problems(seed, 2000):
        lines = p.solution.split("\n")
        assert lines[-1] == f"#### {p.answer}"
        steps = [STEP.search(line) for line in lines[:-1]]
        assert all(steps), p.solution
        assert len(steps) == p.steps and 2 <= p.steps <= 4
        for m in steps:
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert ops[op](a, b) == c, m[0]
            if op == "/":
                assert a % b == 0
            if op == "*":
                assert min(a, b) <= 6
            assert 0 < c <= 999 and a <= 999 and b <= 999
        assert int(steps[-1][4]) == p.answer
        assert set(p.example()) <= set(CHARS)


def test_steps_span_two_to_four_and_templates_vary():
    ps = _problems(3, 3000)
    assert {p.steps for p in ps} == {2, 3, 4}
    openings = {p.question.split(" ", 2)[1] for p in ps}
    assert len({p.question.split(".")[1].split()[-1] for p in ps}) > 10  # varied second sentences
    assert "has" in openings
    assert len({p.answer for p in ps}) > 200


def test_fewshot_prompt_layout():
    shots = _problems(4, 3)
    q = _problems(5, 1)[0]
    prompt = fewshot_prompt(shots, q.question)
    assert prompt.count("Question: ") == 4
    assert prompt.count("#### ") == 3
    assert prompt.endswith(f"Question: {q.question}\nAnswer:")
    assert prompt.split("\n\n")[0] == shots[0].example()


def test_eval_set_k_configurable_and_fits_context():
    five = arith_eval_set(20, k_shot=5, seed=9)
    two = arith_eval_set(20, k_shot=2, seed=9)
    assert [i.question for i in five] == [i.question for i in two]
    assert all(i.prompt.count("#### ") == 5 for i in five)
    assert all(i.prompt.count("#### ") == 2 for i in two)
    assert all(len(i.prompt) + 1 + 320 <= 2048 for i in five)
    assert len({i.question for i in arith_eval_set(200)}) == 200


def test_train_problem_is_deterministic():
    a = [train_problem(random.Random("x")) for _ in range(3)]
    assert a[0] == a[1] == a[2]
