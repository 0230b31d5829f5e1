"""Multi-turn conversations: each later turn repeats the turn before it and adds to it,
so ``prefix_reuse`` of its prompt is a prefix another request already had.

Why: P/D prefix reuse (the decode instance keeps what it was sent; only the uncached
suffix moves) and prefix-aware routing only show on traffic that repeats prefixes.
``conversations`` conversations of ``num_requests`` turns in all; the first turn is a
random ``prompt_tokens``-token prompt, turn t+1 is turn t plus new tokens, as many as
make the repeated part ``prefix_reuse`` of it (0: every turn is a fresh prompt). The
answers are not folded into the next turn (they are not known when the requests are
made). Requests go round by round (every conversation's turn t before any turn t+1), the
conversations in a seeded shuffle each round, so a round-robin router does not keep a
conversation on one instance by accident. Send them with concurrency below
``conversations`` so a turn usually finishes before its follow-up starts.
"""

from __future__ import annotations

import math
import random

from pdflow.bench.workloads.base import RequestResult, WorkRequest
from pdflow.bench.workloads.load import random_token_ids
from pdflow.spec import WorkloadSpec


class MultiTurnWorkload:
    name = "multiturn"
    accuracy_metric = None

    def __init__(self, spec: WorkloadSpec, *, vocab: int, block_tokens: int = 16, kv_bytes_per_block: int = 0):
        self.spec, self.vocab = spec, vocab
        self.block_tokens, self.kv_bytes_per_block = block_tokens, kv_bytes_per_block

    def requests(self) -> list[WorkRequest]:
        s = self.spec
        rng = random.Random(f"multiturn:{s.seed}")
        history: list[list[int]] = [[] for _ in range(s.conversations)]
        out: list[WorkRequest] = []
        for turn in range(math.ceil(s.num_requests / s.conversations)):
            order = list(range(s.conversations))
            rng.shuffle(order)
            for c in order:
                if len(out) == s.num_requests:
                    break
                prev = history[c]
                if not prev or s.prefix_reuse == 0:
                    prompt = random_token_ids(rng, s.prompt_tokens, self.vocab)
                else:
                    new = max(1, math.ceil(len(prev) * (1 - s.prefix_reuse) / s.prefix_reuse))
                    prompt = prev + random_token_ids(rng, new, self.vocab)
                history[c] = prompt
                out.append(WorkRequest(prompt=prompt, max_tokens=s.max_tokens, temperature=s.temperature,
                                       ignore_eos=True, meta={"conversation": c, "turn": turn}))
        return out

    def score(self, requests: list[WorkRequest], results: list[RequestResult]):
        """Prompt tokens served from the answering instance's cache (the usage's
        ``cached_tokens``: under P/D the decode side's) and the prompt KV bytes that had to
        move for each request (its uncached blocks; local prefills counted as if sent)."""
        ok = [r for r in results if r.ok and r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        bs = self.block_tokens
        moved = [(-(-r.prompt_tokens // bs) - r.cached_tokens // bs) * self.kv_bytes_per_block for r in ok]
        return {"multiturn_cache_hit_rate": cached / prompt if prompt else math.nan,
                "multiturn_kv_bytes_per_request": sum(moved) / len(moved) if moved else math.nan}, {}


def hit_rate_bounds(requests: list[WorkRequest], decode_instances: int, block_tokens: int,
                    trials: int = 2000, seed: int = 0) -> tuple[float, float]:
    """(the best any router can do, what placing each turn at random gets) as a decode
    cache hit rate over ``requests`` (this workload's: ``meta`` names conversation and
    turn), with pools that never evict. The best: every turn finds its conversation's
    previous turn whole (in full blocks). At random an instance holds the longest earlier
    turn it was given, so with more instances a turn finds less. Why: the routing goal's
    ratio is bounded by this workload's shape before any policy runs (two instances at
    80% reuse: about 1.3x)."""
    turns: dict[int, list[int]] = {}
    for r in sorted(requests, key=lambda r: (r.meta["conversation"], r.meta["turn"])):
        turns.setdefault(r.meta["conversation"], []).append(len(r.prompt))
    total = sum(sum(lens) for lens in turns.values())
    best = sum((prev // block_tokens) * block_tokens for lens in turns.values() for prev in lens[:-1])
    rng, placed = random.Random(seed), 0
    for _ in range(trials):
        for lens in turns.values():
            held: dict[int, int] = {}
            for n in lens:
                i = rng.randrange(decode_instances)
                placed += (min(held.get(i, 0), n - 1) // block_tokens) * block_tokens
                held[i] = max(held.get(i, 0), n)
    return best / total, placed / (trials * total)
