"""Multi-turn conversations: each later turn repeats the turn before it and adds to it,
so ``prefix_reuse`` of its prompt is a prefix another request already had.

Why: P/D prefix reuse (the decode instance keeps what it was sent and what it generated;
only the uncached suffix moves) and prefix-aware routing only show on traffic that
repeats prefixes. ``conversations`` conversations of ``num_requests`` turns in all; the
first turn is a random ``prompt_tokens``-token prompt, its first ``system_prompt_tokens``
the same in every conversation (a system prompt).

``fold_answers`` (default), as a chat client talks: turn t+1 is turn t's prompt, the
answer's token ids (the API's ``return_token_ids``) and new tokens, as many as make the
repeated part ``prefix_reuse`` of it, sent once the answer is back (closed loop: the
runner's ``drive_turns``, at most ``concurrency`` in flight, ready turns in the order
they became ready), or a seeded, exponential ``think_time_s`` after it. The answer is
the part a decode instance holds and a prefill instance never computed. Off: every turn
built ahead (open loop), turn t+1 is turn t plus new tokens, round by round (every
conversation's turn t before any turn t+1), the conversations in a seeded shuffle each
round, so a round-robin router does not keep a conversation on one instance by accident;
send them with concurrency below ``conversations`` so a turn usually finishes before its
follow-up starts.
"""

from __future__ import annotations

import math
import random

from pdflow.bench.workloads.base import RequestResult, WorkloadFailed, WorkRequest
from pdflow.bench.workloads.load import random_token_ids
from pdflow.spec import WorkloadSpec


class MultiTurnWorkload:
    name = "multiturn"
    accuracy_metric = None

    def __init__(self, spec: WorkloadSpec, *, vocab: int, block_tokens: int = 16, kv_bytes_per_block: int = 0):
        self.spec, self.vocab = spec, vocab
        self.block_tokens, self.kv_bytes_per_block = block_tokens, kv_bytes_per_block

    @property
    def closed_loop(self) -> bool:
        return self.spec.fold_answers

    def requests(self) -> list[WorkRequest]:
        """Every turn (open loop), or each conversation's first turn (``fold_answers``;
        ``follow_up`` makes the rest)."""
        return self._first_turns() if self.closed_loop else self._all_turns()

    def turns_of(self, conversation: int) -> int:
        s = self.spec
        return s.num_requests // s.conversations + (conversation < s.num_requests % s.conversations)

    def _first_turns(self) -> list[WorkRequest]:
        s = self.spec
        order = [c for c in range(s.conversations) if self.turns_of(c)]
        random.Random(f"multiturn:{s.seed}").shuffle(order)
        return [self._turn(c, 0, []) for c in order]

    def follow_up(self, request: WorkRequest, result: RequestResult) -> WorkRequest | None:
        """The conversation's next turn: this prompt, the answer's ids, new tokens. None
        once it has had its turns, or when this turn failed (the conversation ends)."""
        c, turn = request.meta["conversation"], request.meta["turn"] + 1
        if not result.ok or turn >= self.turns_of(c):
            return None
        if len(result.token_ids) != result.completion_tokens:
            raise WorkloadFailed(f"multiturn needs the answers' token ids (return_token_ids): got "
                                 f"{len(result.token_ids)} for {result.completion_tokens} tokens")
        nxt = self._turn(c, turn, request.prompt + result.token_ids)
        if mean := self.spec.think_time_s:  # the user reads the answer, then types
            think = random.Random(f"multiturn:{self.spec.seed}:{c}:{turn}:think").expovariate(1 / mean)
            nxt.arrival_s = result.sent_at_s + result.latency_s + think
        return nxt

    def _turn(self, c: int, turn: int, history: list[int]) -> WorkRequest:
        rng = random.Random(f"multiturn:{self.spec.seed}:{c}:{turn}")  # the same prompts whatever the answer order
        return self._request(self._prompt(rng, history), c, turn)

    def _prompt(self, rng: random.Random, history: list[int]) -> list[int]:
        """A first turn (no history), or ``history`` and as many new tokens as make it
        ``prefix_reuse`` of the prompt."""
        s = self.spec
        if not history or s.prefix_reuse == 0:
            own = random_token_ids(rng, s.prompt_tokens - s.system_prompt_tokens, self.vocab)
            return self._system_prompt() + own
        new = max(1, math.ceil(len(history) * (1 - s.prefix_reuse) / s.prefix_reuse))
        return history + random_token_ids(rng, new, self.vocab)

    def _system_prompt(self) -> list[int]:
        """The first ``system_prompt_tokens`` of every first turn (seeded by the workload's seed)."""
        rng = random.Random(f"multiturn:{self.spec.seed}:system")
        return random_token_ids(rng, self.spec.system_prompt_tokens, self.vocab)

    def _request(self, prompt: list[int], c: int, turn: int) -> WorkRequest:
        s = self.spec
        return WorkRequest(prompt=prompt, max_tokens=s.max_tokens, temperature=s.temperature, ignore_eos=True,
                           meta={"conversation": c, "turn": turn}, return_token_ids=self.closed_loop)

    def _all_turns(self) -> list[WorkRequest]:
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
                history[c] = self._prompt(rng, history[c])
                out.append(self._request(history[c], c, turn))
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


def turn_lengths(rows: list[dict], answers_folded: bool) -> dict[int, list[tuple[int, int]]]:
    """Per conversation, its turns in order as (prompt tokens, tokens of it the next turn
    starts with): the prompt, or with answers folded the prompt and the answer's tokens
    less the last (whose KV no step computed). ``rows``: dicts with ``conversation``,
    ``turn``, ``prompt_tokens``, ``completion_tokens`` (the runner's result rows)."""
    turns: dict[int, list[tuple[int, int]]] = {}
    for r in sorted(rows, key=lambda r: (r["conversation"], r["turn"])):
        n = r["prompt_tokens"]
        turns.setdefault(r["conversation"], []).append(
            (n, n + max(0, r["completion_tokens"] - 1) if answers_folded else n))
    return turns


def hit_rate_bounds(turns: dict[int, list[tuple[int, int]]], decode_instances: int, block_tokens: int,
                    trials: int = 2000, seed: int = 0) -> tuple[float, float]:
    """(the best any router can do, what placing each turn at random gets) as a decode
    cache hit rate over conversations' ``turns`` (``turn_lengths``), with pools that never
    evict. The best: every turn finds what its conversation's previous turn left (in full
    blocks). At random an instance holds the most an earlier turn it was given left, so
    with more instances a turn finds less. Why: the routing goal's ratio is bounded by
    this workload's shape before any policy runs (two instances at 80%: about 1.3x)."""
    total = sum(n for lens in turns.values() for n, _ in lens)
    best = sum(min(left, n - 1) // block_tokens * block_tokens
               for lens in turns.values() for (_, left), (n, _) in zip(lens, lens[1:], strict=False))
    rng, placed = random.Random(seed), 0
    for _ in range(trials):
        for lens in turns.values():
            held: dict[int, int] = {}
            for n, left in lens:
                i = rng.randrange(decode_instances)
                placed += (min(held.get(i, 0), n - 1) // block_tokens) * block_tokens
                held[i] = max(held.get(i, 0), left)
    return best / total, placed / (trials * total)
