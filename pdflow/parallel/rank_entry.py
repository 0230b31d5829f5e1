"""A rank process's own entry point: ``python -m pdflow.parallel.rank_entry --fd N ...``.

Why: ranks started by multiprocessing's spawn re-import the user's main module, so a
script without an ``if __name__ == "__main__":`` guard, or one piped to ``python -``,
killed its ranks at start. Like torchrun, a rank here is a fresh interpreter that imports
only pdflow and the target named by ``module:function``; it gets its context and then
its messages over a socket inherited from the owner.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from pdflow.parallel.launcher import Channel, RankStart, RankTarget
from pdflow.parallel.messages import RankError


def resolve_target(target: str) -> RankTarget:
    """The callable named by ``"package.module:function"``."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _watch_parent(parent_pid: int) -> None:
    """Exit if the owner disappears, even while blocked in a collective."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def run(*, fd: int, parent: int, label: str) -> None:
    """The rank's life: read its start over socket ``fd``, run the target, report a failure.

    Both entries end here: this module's ``main`` (a fresh interpreter) and a fork of the
    rank zygote (``pdflow.parallel.zygote``)."""
    del label  # in argv for ps; errors name the rank by its context
    faulthandler.enable()  # a rank killed by a signal (a crash inside CUDA or NCCL) prints every thread's stack
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    conn = Connection(fd)
    start: RankStart = conn.recv()
    # The owner's import path, so a target importable there is importable here.
    sys.path.extend(p for p in start.sys_path if p not in sys.path)
    channel = Channel(conn)
    try:
        resolve_target(start.target)(start.context, channel)
    except BaseException:
        try:
            channel.send(RankError(rank=start.context.rank, error=traceback.format_exc()))
        finally:
            os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdflow-rank", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="inherited socket to the owner")
    parser.add_argument("--parent", type=int, required=True, help="the owner's pid")
    parser.add_argument("--label", required=True, help="the rank's name, for ps and errors")
    args = parser.parse_args(argv)
    run(fd=args.fd, parent=args.parent, label=args.label)


if __name__ == "__main__":
    main()
