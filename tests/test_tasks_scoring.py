"""Strict / flexible / retrieval scoring on hand-written outputs (lm-eval GSM8K rules)."""

import pytest

from pdflow.bench.tasks import extract_flexible, extract_strict, score_arith, score_retrieval, truncate

GOOD = " Mira has 12 + 7 = 19 apples.\nMira has 19 - 5 = 14 apples.\n#### 14"


def test_correct_worked_answer_scores_both():
    s = score_arith(GOOD, 14)
    assert s.strict and s.flexible


def test_stop_sequences_cut_the_next_example():
    out = GOOD + "\n\nQuestion: Tom has 3 pens.\nAnswer: #### 3"
    assert truncate(out) == GOOD
    s = score_arith(out, 14)
    assert s.strict and s.flexible
    assert not score_arith(out, 3).flexible


def test_missing_hash_line_is_flexible_only():
    s = score_arith(" Mira has 12 + 2 = 14 apples.", 14)
    assert not s.strict and s.flexible


def test_hash_line_right_but_trailing_number_wrong_is_strict_only():
    s = score_arith(" #### 14 and then 15", 14)
    assert s.strict and not s.flexible


def test_wrong_answer_scores_neither():
    s = score_arith(GOOD.replace("#### 14", "#### 15").replace("= 14", "= 15"), 14)
    assert not s.strict and not s.flexible


def test_strict_takes_first_hash_line():
    assert extract_strict("#### 12\n#### 13") == "12"


@pytest.mark.parametrize(
    ("text", "number"),
    [("#### 1,234", "1234"), ("#### 14.", "14"), ("#### -3", "-3"), ("so $14.", "14"), ("no digits", None)],
)
def test_normalisation(text, number):
    got = extract_strict(text) if text.startswith("####") else extract_flexible(text)
    assert got == number


def test_retrieval_exact_match():
    assert score_retrieval(" 4821\nQuestion: What", "4821")
    assert score_retrieval(" 4821.", "4821")
    assert not score_retrieval(" 48210", "4821")
    assert not score_retrieval(" 4812", "4821")
    assert not score_retrieval("\n4821", "4821")
