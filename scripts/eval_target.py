"""Evaluate a target checkpoint with Hugging Face transformers (the project's oracle).

Greedy-decodes held-out k-shot arithmetic (strict / flexible exact match, as lm-eval
scores GSM8K) and retrieval at five depths of the longest trained context, batched with
left padding. Scoring comes from pdflow.bench.tasks, which the engine's eval shares.

    python scripts/eval_target.py --ckpt /tmp/tiny --json /tmp/eval.json
    python scripts/eval_target.py --ckpt /tmp/tiny --n 8 --retrieval-per-depth 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

if importlib.util.find_spec("pdflow") is None:  # a source tree: after site-packages, where the
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # top-level kernels/ shadows nothing

from pdflow.bench.tasks import (
    DEPTHS,
    arith_eval_set,
    retrieval_eval_set,
    score_arith,
    score_retrieval,
)
from pdflow.bench.tasks.scoring import mean


class StopAfter(StoppingCriteria):
    """Per-row stop once the generated tail ends with `stop_ids` (e.g. "\\n\\n")."""

    def __init__(self, stop_ids: list[int]) -> None:
        self.stop = torch.tensor(stop_ids)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        tail = input_ids[:, -len(self.stop):]
        return (tail == self.stop.to(tail.device)).all(dim=-1)


def generate(model, tok, prompts: list[str], *, batch_size: int, max_new_tokens: int, stop: str) -> list[str]:
    """Greedy continuations of `prompts`, longest first so batches pad little."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    stop_ids = tok(stop, add_special_tokens=False)["input_ids"]
    outs: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tok([prompts[i] for i in idx], return_tensors="pt", padding=True).to(model.device)
        with torch.inference_mode():
            gen = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False,
                stopping_criteria=StoppingCriteriaList([StopAfter(stop_ids)]),
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, text in zip(idx, texts, strict=True):
            outs[i] = text
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--n", type=int, default=500, help="held-out arithmetic problems")
    ap.add_argument("--k-shot", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234, help="eval set seed")
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--arith-context", type=int, default=0, help="prompt+answer cap; 0: trained seq_len")
    ap.add_argument("--retrieval-len", type=int, default=0, help="0: the trained seq_len")
    ap.add_argument("--retrieval-per-depth", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=0, help="0: 250 on GPU, 4 on CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default="", help="write results here")
    args = ap.parse_args(argv)

    t0 = time.time()
    ckpt = Path(args.ckpt)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    batch = args.batch_size or (250 if device.startswith("cuda") else 4)
    trained = json.loads((ckpt / "pdflow_training.json").read_text()) if (ckpt / "pdflow_training.json").exists() else {}
    context = args.retrieval_len or trained.get("seq_len", 2048)
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).to(device).eval()

    items = arith_eval_set(args.n, k_shot=args.k_shot, seed=args.seed,
                           max_context=args.arith_context or trained.get("seq_len", 2048))
    outs = generate(model, tok, [it.prompt for it in items], batch_size=batch,
                    max_new_tokens=args.max_new_tokens, stop="\n\n")
    scores = [score_arith(o, it.answer) for o, it in zip(outs, items, strict=True)]
    by_steps: dict[int, list[bool]] = defaultdict(list)
    for it, s in zip(items, scores, strict=True):
        by_steps[it.steps].append(s.strict)
    t_arith = time.time() - t0

    samples = retrieval_eval_set(context_len=context, depths=DEPTHS, per_depth=args.retrieval_per_depth,
                                 seed=args.seed)
    r_outs = generate(model, tok, [s.prompt for s in samples], batch_size=max(1, batch // 5),
                      max_new_tokens=8, stop="\n")
    hits = [score_retrieval(o, s.answer) for o, s in zip(r_outs, samples, strict=True)]
    per_depth = {str(d): mean([h for h, s in zip(hits, samples, strict=True) if s.depth == d]) for d in DEPTHS}

    result = {
        "checkpoint": str(ckpt),
        "arith": {
            "n": len(items), "k_shot": args.k_shot, "seed": args.seed,
            "strict": mean([s.strict for s in scores]), "flexible": mean([s.flexible for s in scores]),
            "strict_by_steps": {str(k): mean(v) for k, v in sorted(by_steps.items())},
            "prompt_tokens_max": max(len(tok(it.prompt)["input_ids"]) for it in items),
        },
        "retrieval": {
            "context_len": context, "per_depth_samples": args.retrieval_per_depth,
            "exact_match": mean(hits), "by_depth": per_depth,
        },
        "examples": [{"question": it.question, "answer": it.answer, "output": o}
                     for it, o in list(zip(items, outs, strict=True))[:3]]
                    + [{"retrieval_answer": s.answer, "depth": s.depth, "output": o}
                       for s, o in list(zip(samples, r_outs, strict=True))[:2]],
        "dtype": args.dtype, "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "arith_seconds": round(t_arith, 1), "seconds": round(time.time() - t0, 1),
        "training": trained,
    }
    print(f"arith {args.k_shot}-shot n={len(items)}: strict {result['arith']['strict']:.4f} "
          f"flexible {result['arith']['flexible']:.4f} by steps {result['arith']['strict_by_steps']}")
    print(f"retrieval @{context}: {result['retrieval']['exact_match']:.4f} by depth {per_depth}")
    print(f"eval took {result['seconds']}s (arith {t_arith:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
