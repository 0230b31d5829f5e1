"""Train / held-out split by a hash of the item's text, so no run ever trains on a test item.

The split depends only on the text, not on a seed or generation order: a held-out
problem stays held out however the training stream is sampled.
"""

from __future__ import annotations

import hashlib

HELDOUT_FRACTION = 0.1


def is_heldout(text: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """True when `text` belongs to the held-out split (about `fraction` of all texts)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1_000_000 < fraction * 1_000_000
