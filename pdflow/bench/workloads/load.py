"""Load workloads: prefill cost (random prompts, one output token), mixed serving load,
and replay of a JSONL trace with arrival times."""

from __future__ import annotations

import json
import random
from pathlib import Path

from pdflow.bench.workloads.base import RequestResult, WorkRequest
from pdflow.spec import WorkloadSpec

# Token ids drawn for random prompts: above the low special ids, below the top tenth of
# the vocabulary where checkpoints usually keep their added special tokens.
FIRST_REGULAR_ID = 4


class TraceError(ValueError):
    """A replay trace line that cannot be sent, named by file and line."""


def random_token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    high = max(FIRST_REGULAR_ID + 1, int(vocab * 0.9))
    return [rng.randrange(FIRST_REGULAR_ID, high) for _ in range(n)]


class PrefillWorkload:
    """Prefill throughput: ``num_requests`` random ``prompt_tokens``-token prompts (no
    two share a prefix, so no cache hit), one output token each."""

    name = "prefill"
    accuracy_metric = None

    def __init__(self, spec: WorkloadSpec, *, vocab: int):
        self.spec, self.vocab = spec, vocab

    def requests(self) -> list[WorkRequest]:
        rng = random.Random(f"prefill:{self.spec.seed}")
        return [WorkRequest(prompt=random_token_ids(rng, self.spec.prompt_tokens, self.vocab), max_tokens=1,
                            ignore_eos=True) for _ in range(self.spec.num_requests)]

    def score(self, requests: list[WorkRequest], results: list[RequestResult]):
        ok = [r for r in results if r.ok]
        return {"prefill_tokens_per_request": float(self.spec.prompt_tokens),
                "prefill_requests_ok": float(len(ok))}, {}


class ServeWorkload:
    """Mixed load: prompt and output lengths uniform in ``input_len``/``output_len``
    (outputs run to length: ``ignore_eos``), Poisson arrivals at ``request_rate``."""

    name = "serve"
    accuracy_metric = None

    def __init__(self, spec: WorkloadSpec, *, vocab: int):
        self.spec, self.vocab = spec, vocab

    def requests(self) -> list[WorkRequest]:
        s = self.spec
        rng = random.Random(f"serve:{s.seed}")
        out, clock = [], 0.0
        for _ in range(s.num_requests):
            arrival = None
            if s.request_rate > 0:
                arrival, clock = clock, clock + rng.expovariate(s.request_rate)
            out.append(WorkRequest(
                prompt=random_token_ids(rng, rng.randint(*s.input_len), self.vocab),
                max_tokens=rng.randint(*s.output_len), temperature=s.temperature, ignore_eos=True,
                arrival_s=arrival,
            ))
        return out

    def score(self, requests: list[WorkRequest], results: list[RequestResult]):
        return {}, {}


class ReplayWorkload:
    """A JSONL trace, one request per line: ``arrival_s`` (seconds; sorted and made
    relative to the first), ``prompt`` (text or token ids) or ``prompt_tokens`` (a random
    prompt of that length), optional ``max_tokens`` (outputs run to it, as the traced ones
    did). Arrivals scale by ``time_scale``."""

    name = "replay"
    accuracy_metric = None
    KEYS = {"arrival_s", "prompt", "prompt_tokens", "max_tokens"}

    def __init__(self, spec: WorkloadSpec, *, vocab: int, base_dir: Path | None = None):
        self.spec, self.vocab = spec, vocab
        if not spec.trace:
            raise TraceError("workload.kind=replay needs workload.trace=<path to a JSONL trace>")
        path = Path(spec.trace)
        self.path = path if path.is_absolute() or base_dir is None else base_dir / path

    def requests(self) -> list[WorkRequest]:
        if not self.path.is_file():
            raise TraceError(f"replay trace {self.path} does not exist (set workload.trace=<file.jsonl>)")
        rng = random.Random(f"replay:{self.spec.seed}")
        rows = []
        for number, line in enumerate(self.path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise TraceError(f"{self.path}:{number}: not JSON ({exc})") from None
            rows.append(self._request(row, number, rng))
        if not rows:
            raise TraceError(f"replay trace {self.path} has no requests")
        rows.sort(key=lambda r: r.arrival_s)
        first = rows[0].arrival_s
        for r in rows:
            r.arrival_s = (r.arrival_s - first) * self.spec.time_scale
        return rows[: self.spec.num_requests] if self.spec.num_requests else rows

    def _request(self, row, number: int, rng: random.Random) -> WorkRequest:
        where = f"{self.path}:{number}"
        if not isinstance(row, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        unknown = set(row) - self.KEYS
        if unknown:
            raise TraceError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(self.KEYS)})")
        arrival = row.get("arrival_s")
        if not isinstance(arrival, int | float) or isinstance(arrival, bool) or arrival < 0:
            raise TraceError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
        if ("prompt" in row) == ("prompt_tokens" in row):
            raise TraceError(f"{where}: give exactly one of prompt and prompt_tokens")
        prompt = row.get("prompt")
        if prompt is None:
            n = row["prompt_tokens"]
            if not isinstance(n, int) or n < 1:
                raise TraceError(f"{where}: prompt_tokens must be a positive integer, got {n!r}")
            prompt = random_token_ids(rng, n, self.vocab)
        elif not isinstance(prompt, str | list):
            raise TraceError(f"{where}: prompt must be text or a list of token ids")
        max_tokens = row.get("max_tokens", self.spec.max_tokens)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise TraceError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
        return WorkRequest(prompt=prompt, max_tokens=max_tokens, temperature=self.spec.temperature,
                           ignore_eos=True, arrival_s=float(arrival))

    def score(self, requests: list[WorkRequest], results: list[RequestResult]):
        late = [r.sent_at_s - q.arrival_s for q, r in zip(requests, results, strict=True)]
        return {"replay_send_lag_max_s": max(late, default=0.0)}, {}

