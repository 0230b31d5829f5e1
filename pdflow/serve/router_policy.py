"""How the router picks instances: round robin, by load, or by prefix overlap.

``load``: the router counts the requests it has in flight at each instance (its own
view of their queues) and tries the least loaded first, then the one whose KV pool is
most free (polled from each instance's ``/metrics`` twice a second). ``prefix``: an approximate,
router-side index of which decode instance got which prompt blocks. A prompt is cut
into blocks the way the engine cuts it (``block_tokens`` token ids per block, each
hash chained to the one before, so a hit means the whole prefix matches); a text
prompt, which the router does not tokenize, is cut every ``CHARS_PER_TOKEN *
block_tokens`` characters instead, which still shares its leading blocks with the
turn before it. Each instance remembers at most ``index_blocks`` hashes (least
recently used out). The instance with the longest leading run of remembered blocks
goes first, the less loaded on a tie; a run shorter by no more than
``router.prefix_min_gain`` of the prompt's blocks is a tie (a system prompt every
conversation shares must not send them all to the instance that saw it first), and the
pick yields to the least loaded instance once it has ``router.prefix_max_skew`` more
requests in flight. Ties and the rest keep round-robin order, so an idle router with no
history behaves like ``round_robin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from pdflow.spec.router import RouterSpec

CHARS_PER_TOKEN = 4


class RoundRobin:
    """Backends in turn; ``pick`` gives the order to try them in for one request."""

    def __init__(self, backends: list[str], *, shift_every: int = 0):
        if not backends:
            raise ValueError("a router needs at least one backend URL")
        self.backends = [b.rstrip("/") for b in backends]
        # Every ``shift_every`` picks, start one further on (pairing with a round robin of
        # that many others, so every pair of the two comes up).
        self.shift_every = shift_every
        self._next = itertools.count()
        self._lock = threading.Lock()

    def pick(self) -> list[str]:
        with self._lock:
            k = next(self._next)
            # the other round robin's place, plus one per round of it
            start = (k % self.shift_every + k // self.shift_every if self.shift_every else k) % len(self.backends)
        return self.backends[start:] + self.backends[:start]


def prompt_blocks(body: bytes, block_tokens: int) -> list[bytes]:
    """The prompt of a completions or chat body, cut into full blocks (see module doc);
    [] for a body without one."""
    try:
        data = json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = prompt
        return [",".join(map(str, ids[i:i + block_tokens])).encode()
                for i in range(0, len(ids) - block_tokens + 1, block_tokens)]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        messages = data.get("messages")
        if not isinstance(messages, list):
            return []
        prompt = "".join(f"{m.get('role')}\n{m.get('content')}\n" for m in messages if isinstance(m, dict))
    size = CHARS_PER_TOKEN * block_tokens
    text = prompt.encode()
    return [text[i:i + size] for i in range(0, len(text) - size + 1, size)]


def chain_hashes(blocks: list[bytes]) -> list[bytes]:
    """Each block's hash chained to the one before: equal hashes, equal prefixes."""
    out, parent = [], b""
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """Block hashes each backend was sent, at most ``capacity`` per backend (LRU)."""

    def __init__(self, backends: list[str], capacity: int):
        self.capacity = capacity
        self._seen: dict[str, OrderedDict[bytes, None]] = {b: OrderedDict() for b in backends}
        self._lock = threading.Lock()

    def overlap(self, backend: str, hashes: list[bytes]) -> int:
        """Leading blocks of the prompt this backend was sent before."""
        seen = self._seen[backend]
        with self._lock:
            return next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))

    def remember(self, backend: str, hashes: list[bytes]) -> None:
        seen = self._seen[backend]
        with self._lock:
            for h in hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self.capacity:
                seen.popitem(last=False)


@dataclass(kw_only=True, slots=True)
class Choice:
    """One request's plan: decode backends in the order to try, the prefill instance
    (None: the decode instance prefills it), and the prompt's block hashes."""

    order: list[str]
    producer: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    prefilling: bool = False  # counted in the producer's in-flight (sent, no answer yet)


class Chooser:
    """Picks decode (and prefill) instances under ``router.policy``; ``started``,
    ``prefilled`` and ``finished`` keep the in-flight counts the load and prefix policies
    read: a decode instance's from the send to the answer's end, a prefill instance's from
    the send to the decode instance's answer (a stream's first token: its prefill and
    transfer are over). Counted only from the answer, a request in its prefill, the most
    expensive part of it, was no load at all, and a producer's count held the decode phase
    it has no part in."""

    def __init__(self, decode: list[str], prefill: list[str] | None, router: RouterSpec, *, block_tokens: int):
        self.router, self.block_tokens = router, block_tokens
        self.decode = RoundRobin(decode)
        self.prefill = RoundRobin(prefill, shift_every=len(self.decode.backends)) if prefill else None
        every = self.decode.backends + (self.prefill.backends if self.prefill else [])
        self.in_flight = dict.fromkeys(every, 0)
        # Free fraction of each instance's KV pool, as its /metrics last said (1.0 until then).
        self.free = dict.fromkeys(every, 1.0)
        self.index = PrefixIndex(every, router.index_blocks)
        self.local_prefills = 0  # every prefill instance was saturated (the router's count)
        self._lock = threading.Lock()

    def choose(self, body: bytes | None) -> Choice:
        """``body``: a generation request's (None: any other request, round robin only)."""
        if body is None or self.router.policy == "round_robin":
            return Choice(order=self.decode.pick(), producer=self._producer([]) if body is not None else None)
        hashes = chain_hashes(prompt_blocks(body, self.block_tokens)) if self.router.policy == "prefix" else []
        return Choice(order=self._rank(self.decode.pick(), hashes), producer=self._producer(hashes), hashes=hashes)

    def started(self, choice: Choice, backend: str) -> None:
        """``choice`` is being sent to ``backend`` (and its producer): counted, and its
        blocks remembered there, so a follow-up sent meanwhile finds them."""
        with self._lock:
            self.in_flight[backend] += 1
            if choice.producer is not None:
                self.in_flight[choice.producer] += 1
                choice.prefilling = True
        if choice.hashes:
            self.index.remember(backend, choice.hashes)
            if choice.producer is not None:
                self.index.remember(choice.producer, choice.hashes)

    def prefilled(self, choice: Choice) -> None:
        """The decode instance answered: the producer's part is over (once)."""
        with self._lock:
            self._release_producer(choice)

    def finished(self, choice: Choice, backend: str) -> None:
        """The answer ended (or the send failed): every count ``started`` took, released."""
        with self._lock:
            self.in_flight[backend] -= 1
            self._release_producer(choice)

    def _release_producer(self, choice: Choice) -> None:
        if choice.prefilling:
            choice.prefilling = False
            self.in_flight[choice.producer] -= 1

    def set_free(self, backend: str, fraction: float) -> None:
        """An instance's free KV-block fraction, from its /metrics (``poll_free``)."""
        self.free[backend] = fraction

    def _rank(self, order: list[str], hashes: list[bytes]) -> list[str]:
        """Longest prefix overlap first (prefix policy; overlaps within
        ``router.prefix_min_gain`` of the prompt's blocks of the longest are a tie), then
        fewest in flight, then the most free KV blocks; stable, so round-robin order breaks
        the remaining ties. The overlap's pick yields to the least loaded instance when it
        has ``router.prefix_max_skew`` more requests in flight."""
        with self._lock:
            load = dict(self.in_flight)
        overlap = {b: self.index.overlap(b, hashes) if hashes else 0 for b in order}
        near = max(overlap.values()) - self.router.prefix_min_gain * len(hashes)

        def tier(b: str) -> tuple[int, int]:  # near the longest run: one tier; below it, by run
            return (0, 0) if overlap[b] >= near else (1, -overlap[b])

        ranked = sorted(order, key=lambda b: (*tier(b), load[b], -self.free[b]))
        skew = self.router.prefix_max_skew
        idle = min(ranked, key=lambda b: load[b])  # the first of the least loaded, in ranked order
        if skew and load[ranked[0]] - load[idle] >= skew:
            ranked.remove(idle)
            ranked.insert(0, idle)
        return ranked

    def _producer(self, hashes: list[bytes]) -> str | None:
        if self.prefill is None:
            return None
        order = self.prefill.pick()
        if self.router.policy == "round_robin":
            return order[0]
        order = self._rank(order, hashes)
        cap = self.router.max_prefills_in_flight
        with self._lock:
            if cap and all(self.in_flight[p] >= cap for p in order):
                self.local_prefills += 1
                return None
        return order[0]


FREE_GAUGE, TOTAL_GAUGE = "pdflow_kv_blocks_free", "pdflow_kv_blocks_total"


def free_fraction(metrics_text: str) -> float | None:
    """An instance's free KV-block fraction from its ``/metrics`` text (None without a
    positive ``pdflow_kv_blocks_total``). The two unlabelled gauges are read off their own
    lines: the router polls every instance twice a second on its event loop, and parsing
    all ~200 samples of each with the exposition parser was a tenth of its CPU."""
    values = {}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in (FREE_GAUGE, TOTAL_GAUGE):
            values[name] = float(rest.split()[0])  # a timestamp may follow the value
    total = values.get(TOTAL_GAUGE)
    return values.get(FREE_GAUGE, 0.0) / total if total else None


async def poll_free(chooser: Chooser, client, *, every_s: float = 0.5, headers: dict | None = None) -> None:
    """Keep ``chooser.free`` current from each instance's ``pdflow_kv_blocks_free`` /
    ``pdflow_kv_blocks_total`` (runs until cancelled; an instance that does not answer
    keeps its last value)."""
    async def one(backend: str) -> None:
        try:
            r = await client.get(backend + "/metrics", timeout=2.0, headers=headers or {})
        except Exception:  # unreachable now: the request path reports that
            return
        if r.status_code != 200:
            return
        with contextlib.suppress(ValueError, IndexError):  # not a pdflow instance's gauges
            fraction = free_fraction(r.text)
            if fraction is not None:
                chooser.set_free(backend, fraction)

    while True:
        await asyncio.gather(*(one(b) for b in chooser.free))
        await asyncio.sleep(every_s)
