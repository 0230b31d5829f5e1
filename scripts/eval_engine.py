"""Evaluate a checkpoint through pdflow's own engine (the issue-4 figures, served).

python scripts/eval_engine.py                                  # shipped tiny model, CPU
python scripts/eval_engine.py --device cuda --n 500 --json out.json
python scripts/eval_engine.py --tp 2                           # a TP2 instance
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pdflow:assets/tiny")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--per-depth", type=int, default=20)
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto", help="auto: triton on cuda, torch on cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="0: from memory")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from pdflow import LLM
    from pdflow.bench.accuracy import evaluate_accuracy
    from pdflow.spec import ParallelSpec

    parallel = ParallelSpec(
        tp=args.tp,
        pp=args.pp,
        device=args.device,
        block_size=128,
        kv_page_tokens=args.page,
        attention_backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
        num_kv_blocks=args.num_kv_blocks or (args.max_num_seqs * 24),
        memory=0.5,
    )
    began = time.time()
    with LLM(args.model, parallel, dtype=args.dtype) as llm:
        result = evaluate_accuracy(llm, n=args.n, per_depth=args.per_depth, context_len=args.context_len)
    seconds = time.time() - began
    print(
        f"arith 5-shot n={result.n_arith}: strict {result.strict:.4f} flexible {result.flexible:.4f} "
        f"by steps {result.strict_by_steps}"
    )
    print(f"retrieval @{args.context_len}: {result.retrieval:.4f} by depth {result.retrieval_by_depth}")
    print(f"{args.model} on {args.device} ({parallel.attention_backend}, tp{args.tp} pp{args.pp}): {seconds:.0f}s")
    if args.json:
        data = dataclasses.asdict(result) | {"seconds": round(seconds, 1), "args": vars(args)}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
