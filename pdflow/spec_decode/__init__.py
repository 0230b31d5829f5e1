"""Speculative decoding: drafters (dspark, eagle, eagle3), verification, acceptance stats.

The worker drives a drafter through ``Drafter`` (see ``drafter.py`` for the per-step
calls), verifies with ``verify`` and counts with ``AcceptanceStats``.
"""

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
