"""Accuracy workloads on the shipped tasks: k-shot arithmetic and needle retrieval,
scored by the same rules as ``pdflow.bench.accuracy`` (lm-eval's GSM8K strict/flexible)."""

from __future__ import annotations

from collections import defaultdict

from pdflow.bench.tasks import (
    ARITH_STOPS,
    RETRIEVAL_STOPS,
    arith_eval_set,
    retrieval_eval_set,
    score_arith,
    score_retrieval,
)
from pdflow.bench.tasks.scoring import mean
from pdflow.bench.workloads.base import RequestResult, WorkRequest
from pdflow.spec import WorkloadSpec

NEEDLE_MAX_TOKENS = 8  # a four-digit code and its newline


class ArithWorkload:
    """``num_requests`` held-out problems as ``k_shot`` prompts fitting ``context_len``."""

    name = "arith"
    accuracy_metric = "arith_strict"

    def __init__(self, spec: WorkloadSpec):
        self.spec = spec

    def requests(self) -> list[WorkRequest]:
        s = self.spec
        items = arith_eval_set(s.num_requests, k_shot=s.k_shot, seed=s.seed, max_context=s.context_len)
        return [WorkRequest(prompt=it.prompt, max_tokens=s.max_tokens, temperature=s.temperature,
                            stop=list(ARITH_STOPS), meta={"answer": it.answer, "steps": it.steps})
                for it in items]

    def score(self, requests: list[WorkRequest], results: list[RequestResult]):
        scores = [score_arith(r.text, q.meta["answer"]) if r.ok else None
                  for q, r in zip(requests, results, strict=True)]
        by_steps: dict[int, list[bool]] = defaultdict(list)
        for q, s in zip(requests, scores, strict=True):
            by_steps[q.meta["steps"]].append(bool(s and s.strict))
        strict = {f"steps_{k}": mean(v) for k, v in sorted(by_steps.items())}
        metrics = {
            "arith_strict": mean([bool(s and s.strict) for s in scores]),
            "arith_flexible": mean([bool(s and s.flexible) for s in scores]),
        } | {f"arith_strict_{k}": v for k, v in strict.items()}
        for q, s in zip(requests, scores, strict=True):
            q.meta["strict"], q.meta["flexible"] = bool(s and s.strict), bool(s and s.flexible)
        return metrics, {"arith strict accuracy by steps": strict}


class NeedleWorkload:
    """``num_requests`` held-out facts at each depth of a ``context_len`` haystack."""

    name = "needle"
    accuracy_metric = "needle_accuracy"

    def __init__(self, spec: WorkloadSpec):
        self.spec = spec

    def requests(self) -> list[WorkRequest]:
        s = self.spec
        samples = retrieval_eval_set(context_len=s.context_len, depths=tuple(s.depths),
                                     per_depth=s.num_requests, seed=s.seed)
        return [WorkRequest(prompt=x.prompt, max_tokens=NEEDLE_MAX_TOKENS, temperature=s.temperature,
                            stop=list(RETRIEVAL_STOPS), meta={"answer": x.answer, "depth": x.depth})
                for x in samples]

    def score(self, requests: list[WorkRequest], results: list[RequestResult]):
        hits = [r.ok and score_retrieval(r.text, q.meta["answer"]) for q, r in zip(requests, results, strict=True)]
        by_depth = {
            f"depth_{d:.2f}": mean([h for h, q in zip(hits, requests, strict=True) if q.meta["depth"] == d])
            for d in self.spec.depths
        }
        for q, h in zip(requests, hits, strict=True):
            q.meta["hit"] = h
        metrics = {"needle_accuracy": mean(hits)} | {f"needle_accuracy_{k}": v for k, v in by_depth.items()}
        return metrics, {"needle accuracy by depth": by_depth}
