"""Task generators and scorers for the shipped tiny model (standard library only).

Arithmetic word problems (GSM8K-shaped, strict/flexible scoring) and long-context
retrieval, with train/held-out splits by text hash. Importing this package pulls in no
torch, tokenizers or transformers, so training scripts and the engine can share it.
"""

from pdflow.bench.tasks.arith import ArithProblem, fewshot_prompt, sample_problem
from pdflow.bench.tasks.corpus import arith_document, train_problem, training_text
from pdflow.bench.tasks.evalsets import DEPTHS, ArithItem, arith_eval_set, retrieval_eval_set
from pdflow.bench.tasks.retrieval import Fact, RetrievalSample, make_sample
from pdflow.bench.tasks.scoring import (
    ARITH_STOPS,
    RETRIEVAL_STOPS,
    ArithScore,
    extract_flexible,
    extract_strict,
    score_arith,
    score_retrieval,
    truncate,
)
from pdflow.bench.tasks.splits import is_heldout

__all__ = [
    "ARITH_STOPS",
    "DEPTHS",
    "RETRIEVAL_STOPS",
    "ArithItem",
    "ArithProblem",
    "ArithScore",
    "Fact",
    "RetrievalSample",
    "arith_document",
    "arith_eval_set",
    "extract_flexible",
    "extract_strict",
    "fewshot_prompt",
    "is_heldout",
    "make_sample",
    "retrieval_eval_set",
    "sample_problem",
    "score_arith",
    "score_retrieval",
    "train_problem",
    "training_text",
    "truncate",
]
