"""An API front that starts slowly, as one whose imports crawl on a loaded host does: the
supervisor test runs it as a front process (``Supervisor.FRONT_TARGET``)."""

from __future__ import annotations

import time

SLOW_START_S = 6.0


def front_main(*args) -> None:
    time.sleep(SLOW_START_S)
    from pdflow.serve.front_process import front_main as serve

    serve(*args)
