"""Acceptance statistics, per request and per draft position, mergeable anywhere.

Acceptance rate = accepted / proposed; tokens per forward = (accepted + 1) per verify
step, i.e. (accepted + verify_steps) / verify_steps. Position i counts as proposed when
a step offered at least i+1 drafts and as accepted when at least i+1 were accepted, so
the per-position rates show where a draft goes wrong (a wrong draft cut shows at every
position, a weak drafter mostly late). Counts, not rates, travel and merge, so totals
over ranks and requests are exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec


class AcceptanceStats(msgspec.Struct, kw_only=True):
    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    # Index i: steps that offered / accepted a draft at position i.
    proposed_at: list[int] = []
    accepted_at: list[int] = []

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verify step that offered ``num_drafts`` and accepted ``num_accepted``."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        self.verify_steps += 1
        self.proposed += num_drafts
        self.accepted += num_accepted
        _grow(self.proposed_at, num_drafts)
        _grow(self.accepted_at, num_drafts)
        for i in range(num_drafts):
            self.proposed_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def merged(self, other: AcceptanceStats) -> AcceptanceStats:
        width = max(len(self.proposed_at), len(other.proposed_at))
        return AcceptanceStats(
            verify_steps=self.verify_steps + other.verify_steps,
            proposed=self.proposed + other.proposed,
            accepted=self.accepted + other.accepted,
            proposed_at=_add(self.proposed_at, other.proposed_at, width),
            accepted_at=_add(self.accepted_at, other.accepted_at, width),
        )

    @classmethod
    def merge_all(cls, parts: Iterable[AcceptanceStats]) -> AcceptanceStats:
        total = cls()
        for part in parts:
            total = total.merged(part)
        return total

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def rate_at(self) -> list[float]:
        """Acceptance rate at each draft position."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)]


def _grow(counts: list[int], width: int) -> None:
    if len(counts) < width:
        counts.extend([0] * (width - len(counts)))


def _add(a: list[int], b: list[int], width: int) -> list[int]:
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width)]


class AcceptanceTracker:
    """Per-request stats on the rank that verifies; a finished request's stats go out with
    its output (``pop``), and ``total`` folds in everything seen."""

    def __init__(self) -> None:
        self.requests: dict[str, AcceptanceStats] = {}
        self._finished = AcceptanceStats()

    def record(self, seq_ids: Sequence[str], num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        for sid, n, a in zip(seq_ids, num_drafts, num_accepted, strict=True):
            self.requests.setdefault(sid, AcceptanceStats()).record(int(n), int(a))

    def pop(self, seq_id: str) -> AcceptanceStats:
        stats = self.requests.pop(seq_id, None) or AcceptanceStats()
        self._finished = self._finished.merged(stats)
        return stats

    def total(self) -> AcceptanceStats:
        return AcceptanceStats.merge_all([self._finished, *self.requests.values()])


encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(AcceptanceStats)


def decode(data: bytes) -> AcceptanceStats:
    return _decoder.decode(data)
