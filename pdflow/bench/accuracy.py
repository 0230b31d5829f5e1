"""Accuracy of a serving engine on the shipped tasks: five-shot arithmetic (strict and
flexible, as lm-eval scores GSM8K) and long-context retrieval by depth.

Takes any object with the offline engine's ``generate(prompts, sampling)`` so the same
evaluation runs on one process, a TP/PP instance, or (later) a P/D deployment.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pdflow.bench.tasks import (
    ARITH_STOPS,
    DEPTHS,
    RETRIEVAL_STOPS,
    arith_eval_set,
    retrieval_eval_set,
    score_arith,
    score_retrieval,
)
from pdflow.bench.tasks.scoring import mean


@dataclass(kw_only=True, slots=True)
class AccuracyResult:
    n_arith: int
    strict: float
    flexible: float
    strict_by_steps: dict[str, float]
    n_retrieval: int
    retrieval: float
    retrieval_by_depth: dict[str, float]
    examples: list[dict] = field(default_factory=list)


def evaluate_accuracy(
    llm,
    *,
    n: int = 500,
    k_shot: int = 5,
    seed: int = 1234,
    context_len: int = 2048,
    per_depth: int = 20,
    retrieval_len: int | None = None,
    max_new_tokens: int = 320,
) -> AccuracyResult:
    """Greedy decoding of ``n`` held-out k-shot arithmetic prompts (fitting
    ``context_len``) and ``per_depth`` retrieval samples of ``retrieval_len`` tokens
    (default ``context_len``) at each of five depths, scored with the tasks' own rules."""
    from pdflow.engine.sampling_params import SamplingParams

    items = arith_eval_set(n, k_shot=k_shot, seed=seed, max_context=context_len)
    arith = SamplingParams(temperature=0, max_tokens=max_new_tokens, stop=list(ARITH_STOPS))
    outs = [o.text for o in llm.generate([it.prompt for it in items], arith)] if items else []
    scores = [score_arith(o, it.answer) for o, it in zip(outs, items, strict=True)]
    by_steps: dict[int, list[bool]] = defaultdict(list)
    for it, s in zip(items, scores, strict=True):
        by_steps[it.steps].append(s.strict)

    samples = retrieval_eval_set(
        context_len=retrieval_len or context_len, depths=DEPTHS, per_depth=per_depth, seed=seed
    )
    lookup = SamplingParams(temperature=0, max_tokens=8, stop=list(RETRIEVAL_STOPS))
    r_outs = [o.text for o in llm.generate([s.prompt for s in samples], lookup)] if samples else []
    hits = [score_retrieval(o, s.answer) for o, s in zip(r_outs, samples, strict=True)]
    return AccuracyResult(
        n_arith=len(items),
        strict=mean([s.strict for s in scores]),
        flexible=mean([s.flexible for s in scores]),
        strict_by_steps={str(k): mean(v) for k, v in sorted(by_steps.items())},
        n_retrieval=len(samples),
        retrieval=mean(hits),
        retrieval_by_depth={
            str(d): mean([h for h, s in zip(hits, samples, strict=True) if s.depth == d])
            for d in DEPTHS
            if samples
        },
        examples=[
            {"question": it.question, "answer": it.answer, "output": o}
            for it, o in list(zip(items, outs, strict=True))[:2]
        ],
    )
