"""Speculative decoding: drafters (dspark, eagle, eagle3), verification, acceptance stats.

The worker drives a drafter through ``Drafter`` (see ``drafter.py`` for the per-step
calls), verifies with ``verify`` and counts with ``AcceptanceStats``.

The names below are imported from their submodule on first use (PEP 562): the request
bookkeeping (``pdflow.engine.sequence``) imports the torch-free ``stats``, and processes
that never draft (the router, a server's supervisor) then need not import torch and the
drafters for it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdflow.spec_decode.checkpoint import build_drafter, drafter_config_for, load_drafter, save_drafter
    from pdflow.spec_decode.config import DrafterConfig, DrafterConfigMismatch
    from pdflow.spec_decode.drafter import (
        ContextBatch,
        ContextFeatureMismatch,
        DraftDuties,
        Drafter,
        DraftPlacementMismatch,
        Proposal,
        ProposeBatch,
        duties,
    )
    from pdflow.spec_decode.dspark import DSparkDrafter
    from pdflow.spec_decode.eagle import Eagle3Drafter, Eagle3UnderPP, EagleDrafter
    from pdflow.spec_decode.ledger import ContextGap
    from pdflow.spec_decode.sampling import SamplingBatch
    from pdflow.spec_decode.stats import AcceptanceStats, AcceptanceTracker
    from pdflow.spec_decode.verify import VerifyResult, padded_rows, verify

# Each exported name -> the submodule that defines it.
_SUBMODULE = {
    **dict.fromkeys(("build_drafter", "drafter_config_for", "load_drafter", "save_drafter"), "checkpoint"),
    **dict.fromkeys(("DrafterConfig", "DrafterConfigMismatch"), "config"),
    **dict.fromkeys(("ContextBatch", "ContextFeatureMismatch", "DraftDuties", "Drafter", "DraftPlacementMismatch",
                     "Proposal", "ProposeBatch", "duties"), "drafter"),
    "DSparkDrafter": "dspark",
    **dict.fromkeys(("Eagle3Drafter", "Eagle3UnderPP", "EagleDrafter"), "eagle"),
    "ContextGap": "ledger",
    "SamplingBatch": "sampling",
    **dict.fromkeys(("AcceptanceStats", "AcceptanceTracker"), "stats"),
    **dict.fromkeys(("VerifyResult", "padded_rows", "verify"), "verify"),
}


def __getattr__(name: str):
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
    setattr(sys.modules[__name__], name, value)  # later lookups skip this hook
    return value


class _Package(types.ModuleType):
    """Importing the submodule ``verify`` binds it on the package; the package's ``verify``
    stays the function, as it was when this file imported every name eagerly."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _SUBMODULE.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "AcceptanceStats",
    "AcceptanceTracker",
    "ContextBatch",
    "ContextFeatureMismatch",
    "ContextGap",
    "DSparkDrafter",
    "DraftDuties",
    "DraftPlacementMismatch",
    "Drafter",
    "DrafterConfig",
    "DrafterConfigMismatch",
    "Eagle3Drafter",
    "Eagle3UnderPP",
    "EagleDrafter",
    "Proposal",
    "ProposeBatch",
    "SamplingBatch",
    "VerifyResult",
    "build_drafter",
    "drafter_config_for",
    "duties",
    "load_drafter",
    "padded_rows",
    "save_drafter",
    "verify",
]
