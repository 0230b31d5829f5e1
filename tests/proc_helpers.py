"""Processes a test started, read from /proc."""

from __future__ import annotations

import contextlib
from pathlib import Path


def children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (a supervisor thread may start some)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out
