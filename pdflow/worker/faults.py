"""Fault injection for tests: a rank dies or fails at a named point, for real.

``PDFLOW_TEST_FAULT=<point>:<role>:<rank>:<action>`` (several separated by commas), read
from the rank's environment (rank processes inherit the owner's); ``<rank>@<consumer>``
narrows an export fault to the exports to one consumer instance. ``action`` is ``die``
(the process exits at once, as a killed rank would), ``error`` (the operation raises,
as a failed transfer would) or ``hold`` (the operation waits until the file named by
``PDFLOW_TEST_FAULT_RELEASE`` exists, at most ``HOLD_LIMIT_S``: a transfer still in flight
for as long as a test needs, without a clock). Unset in every real run; costs one dict
lookup per check.
"""

from __future__ import annotations

import os
import time

ENV = "PDFLOW_TEST_FAULT"
RELEASE_ENV = "PDFLOW_TEST_FAULT_RELEASE"
HOLD_LIMIT_S = 120.0


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def inject_fault(point: str, role: str, rank: int, *, consumer: str | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    here = f"{point}:{role}:{rank}"
    for item in spec.split(","):
        where, _, action = item.rpartition(":")
        if where == here or (consumer is not None and where == f"{here}@{consumer}"):
            if action == "die":
                os._exit(17)
            if action == "hold":
                _hold(os.environ.get(RELEASE_ENV, ""))
                continue
            raise InjectedFault(f"injected {point} fault on {role} rank {rank}")


def _hold(release: str) -> None:
    deadline = time.monotonic() + HOLD_LIMIT_S
    while release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
