"""Mooncake's own (glog) log lines: quiet by default, all of them under ``-v``.

Why: every engine logs ``E... Local segment descriptor not found`` (and a few warnings)
while it initialises, before any segment exists. It is not an error, but eight ranks
printing it are the first thing ``pdflow run`` shows, and it reads as one. Mooncake
takes its level from ``MC_LOG_LEVEL`` when the engine is built (TRACE, INFO, WARNING,
ERROR; nothing above ERROR), so ERROR alone does not hide that line: the engine's
construction and ``initialize`` run with the process's stderr (fd 2, where glog
writes) redirected to a file, and everything in it that is not a glog line is written
back. When initialisation fails, the caller puts the dropped lines into its error.

``PDFLOW_VERBOSE=1`` (``pdflow run -v``, ``pdflow serve -v``; rank processes inherit
it) keeps Mooncake at INFO and redirects nothing. A user's own ``MC_LOG_LEVEL`` wins.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

VERBOSE_ENV = "PDFLOW_VERBOSE"
# glog's line prefix (severity letter, MMDD, time, thread id), and the notice glog prints
# once when a library logs before InitGoogleLogging.
GLOG_LINE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ |WARNING: Logging before InitGoogleLogging)")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def set_mooncake_level() -> None:
    """Before Mooncake is imported and its engine built: its level from our verbosity."""
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if verbose() else "ERROR")


class Dropped:
    """The glog lines a quiet block kept off the terminal (for an error message)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def text(self) -> str:
        return "".join(self.lines).strip()


@contextlib.contextmanager
def quiet_native_log() -> Iterator[Dropped]:
    """Run the block with fd 2 redirected; write back what is not a glog line."""
    dropped = Dropped()
    if verbose():
        yield dropped
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield dropped
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = []
            for line in sink.read().decode(errors="replace").splitlines(keepends=True):
                (dropped.lines if GLOG_LINE.match(line) else kept).append(line)
            if kept:
                os.write(2, "".join(kept).encode())
