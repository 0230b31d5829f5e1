"""Errors of the transfer layer: each ends one request, never the process."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A write failed, was refused, or missed its deadline; nothing says the bytes landed."""


class PairingRefused(RuntimeError):
    """A producer turned a consumer rank down at pairing; carries the graph's refusals."""

    def __init__(self, refusals):
        self.refusals = list(refusals)
        lines = "\n".join(f"  - {r}" for r in self.refusals)
        super().__init__(f"pairing refused ({len(self.refusals)} reasons):\n{lines}")
