"""Which draft context entries of each request are in the pool, so a missed write fails.

A drafter's context K/V holds one entry per position (dspark: the token's tapped
features; a chain drafter: the target feature at t paired with token t+1). If a target
forward's write is skipped (one chunk of a chunked prefill, say), the drafter still
runs and only acceptance falls. The ledger turns that into a ``ContextGap`` naming the
request and positions. Host ints only.
"""

from __future__ import annotations

from collections.abc import Sequence


class ContextGap(RuntimeError):
    """Draft context K/V is missing for positions a write or proposal depends on."""


class ContextLedger:
    """Per request: ``valid`` entries [0, valid) are final; ``written`` entries
    [0, written) hold the last write, committed or not."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.valid: dict[str, int] = {}
        self.written: dict[str, int] = {}
        # Position after the last row of the request's last write.
        self.forward_end: dict[str, int] = {}

    def wrote(self, seq_id: str, start: int, stop: int, forward_end: int) -> None:
        """A write of entries [start, stop) from a forward over tokens [start,
        forward_end): it must continue the committed entries."""
        valid = self.valid.get(seq_id, 0)
        if start > valid:
            if start <= self.written.get(seq_id, 0):
                why = (f"entries [{valid}, {start}) were written but never committed: call commit "
                       "after every target step (a producer too)")
            else:
                why = (f"entries [{valid}, {start}) were never written: call write_context_kv after "
                       "every target forward, each chunk of a chunked prefill included (or adopt "
                       "entries a prefix-cache hit or a transfer brought)")
            raise ContextGap(f"{self.kind} drafter, request {seq_id!r}: a write from entry {start}, but {why}")
        self.written[seq_id] = max(stop, start)
        self.forward_end[seq_id] = forward_end

    def require(self, seq_id: str, entries: int, what: str) -> None:
        have = self.valid.get(seq_id, 0)
        if have < entries:
            raise ContextGap(
                f"{self.kind} drafter, request {seq_id!r}: {what} needs context entries [0, {entries}) but "
                f"only [0, {have}) are committed; write and commit every target step first"
            )

    def commit(self, seq_id: str, entries: int) -> None:
        """Entries [0, entries) are final (capped at what was written); rows written past
        them (rejected drafts) are dropped."""
        valid = max(self.valid.get(seq_id, 0), min(entries, self.written.get(seq_id, 0)))
        self.valid[seq_id] = self.written[seq_id] = valid

    def extend(self, seq_id: str, entries: int) -> None:
        """A proposal wrote entries up to ``entries`` itself (a chain drafter's first step)."""
        self.valid[seq_id] = max(self.valid.get(seq_id, 0), entries)
        self.written[seq_id] = max(self.written.get(seq_id, 0), entries)

    def rollback(self, seq_id: str, entries: int) -> None:
        """Forget everything from ``entries`` on (preempted or truncated)."""
        valid = min(self.valid.get(seq_id, 0), entries)
        self.valid[seq_id] = self.written[seq_id] = valid

    def adopt(self, seq_id: str, entries: int) -> None:
        """The pool already holds entries [0, entries): a prefix-cache hit, or a transfer
        from a producer (which reports its own ``valid``)."""
        self.valid[seq_id] = self.written[seq_id] = entries

    def release(self, seq_ids: Sequence[str]) -> None:
        for sid in seq_ids:
            for table in (self.valid, self.written, self.forward_end):
                table.pop(sid, None)
