"""Retrieval generator: length bound, needle depth, determinism, training documents."""

import random

import pytest

from pdflow.bench.tasks import DEPTHS, make_sample, retrieval_eval_set
from pdflow.bench.tasks.retrieval import ANSWER_TAIL, training_document
from pdflow.bench.tasks.vocab import CHARS


@pytest.mark.parametrize("context_len", [256, 2048])
@pytest.mark.parametrize("depth", DEPTHS)
def test_sample_fits_context_and_needle_sits_at_depth(context_len, depth):
    s = make_sample(random.Random(f"{context_len}:{depth}"), context_len=context_len, depth=depth)
    total = 1 + len(s.prompt) + ANSWER_TAIL
    assert context_len - 60 <= total <= context_len
    hay, question = s.prompt.rsplit("\n", 2)[0], s.prompt.split("\n")[-2]
    start = hay.index(f" is {s.answer}.")
    needle = hay.rfind("The ", 0, start)
    assert abs(needle / len(hay) - depth) <= 50 / len(hay)  # within a filler sentence
    assert question.startswith("Question: What is the ")
    assert hay.count(s.answer) == 1
    assert set(s.prompt) <= set(CHARS)


def test_eval_set_deterministic_and_spans_depths():
    a = retrieval_eval_set(context_len=512, per_depth=3, seed=5)
    assert a == retrieval_eval_set(context_len=512, per_depth=3, seed=5)
    assert a != retrieval_eval_set(context_len=512, per_depth=3, seed=6)
    assert sorted({s.depth for s in a}) == sorted(DEPTHS)
    assert len({s.answer for s in a}) > 10


def test_training_document_answers_every_fact():
    rng = random.Random(0)
    for _ in range(50):
        doc = training_document(rng, context_len=1024)
        assert len(doc) + 2 <= 1024
        qas = doc.split("\nQuestion: What is the ")[1:]
        assert qas
        for qa in qas:
            ask, answer = qa.split("?\nAnswer: ")
            relation, name = ask.split(" of ")
            assert f"The {relation} of {name} is {answer}." in doc
