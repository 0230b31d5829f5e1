"""Mooncake's own (glog) log lines: quiet by default, all of them under ``-v``.

Why: every engine logs ``E... Local segment descriptor not found`` while it initialises;
not an error, but it reads as one, and ``MC_LOG_LEVEL=ERROR`` (the highest) still shows
it. So the engine is built with fd 2 redirected to a file, and what is not a glog line is
written back (a failed initialise puts the dropped lines into its error).
``PDFLOW_VERBOSE=1`` (``-v``) keeps Mooncake at INFO and redirects nothing; a user's own
``MC_LOG_LEVEL`` wins.
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


@contextlib.contextmanager
def quiet_native_log() -> Iterator[list[str]]:
    """Run the block with fd 2 redirected; write back what is not a glog line, and yield
    the glog lines kept off the terminal (for an error message)."""
    dropped: list[str] = []
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
                (dropped if GLOG_LINE.match(line) else kept).append(line)
            if kept:
                os.write(2, "".join(kept).encode())
