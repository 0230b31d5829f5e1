"""The shipped model's accuracy measured through pdflow's own engine (small slice)."""

from __future__ import annotations

import pytest

from pdflow.bench.accuracy import evaluate_accuracy


class Parrot:
    """An 'engine' that answers every prompt with a fixed text: the scorer must see it."""

    def __init__(self, text: str):
        self.text = text

    def generate(self, prompts, sampling):
        class Out:
            text = self.text

        return [Out() for _ in prompts]


def test_scores_come_from_the_outputs():
    wrong = evaluate_accuracy(Parrot(" 1 + 1 = 2\n#### 2"), n=20, per_depth=1, retrieval_len=512)
    assert wrong.n_arith == 20 and wrong.strict < 0.5 and wrong.retrieval == 0.0


@pytest.mark.slow
def test_shipped_model_solves_held_out_problems_through_the_engine():
    from pdflow import LLM
    from pdflow.spec import ParallelSpec

    parallel = ParallelSpec(block_size=128, kv_page_tokens=16, num_kv_blocks=64, max_num_seqs=8)
    with LLM("pdflow:assets/tiny", parallel) as llm:
        result = evaluate_accuracy(llm, n=4, k_shot=2, per_depth=1, retrieval_len=512)
    assert result.strict == 1.0 and result.flexible == 1.0
    assert result.retrieval == 1.0 and set(result.retrieval_by_depth) == {
        "0.01",
        "0.25",
        "0.5",
        "0.75",
        "0.99",
    }
