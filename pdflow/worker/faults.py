"""Fault injection for tests: a rank dies or fails at a named point, for real.

``PDFLOW_TEST_FAULT=<point>:<role>:<rank>:<action>`` (several separated by commas), read
from the rank's environment (rank processes inherit the owner's): ``action`` is ``die``
(the process exits at once, as a killed rank would) or ``error`` (the operation raises,
as a failed transfer would). Unset in every real run; costs one dict lookup per check.
"""

from __future__ import annotations

import os

ENV = "PDFLOW_TEST_FAULT"


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def inject_fault(point: str, role: str, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        where, _, action = item.rpartition(":")
        if where == f"{point}:{role}:{rank}":
            if action == "die":
                os._exit(17)
            raise InjectedFault(f"injected {point} fault on {role} rank {rank}")
