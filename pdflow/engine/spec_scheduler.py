"""How many of a sequence's drafts its next step scores, and how far ahead it reserves.

A decode step of a sequence with drafts computes [last token, drafts]: up to k+1 rows.
The drafts are cut so the step stays inside the token budget, never emits past
``max_tokens`` or ``max_model_len``, and the step reserves blocks for the k positions
its next proposal will occupy (a chain drafter writes entries there while proposing;
the next verify writes the target's K/V there).
"""

from __future__ import annotations

from pdflow.engine.sequence import Sequence


def drafts_to_score(seq: Sequence, budget: int, max_model_len: int) -> int:
    """Drafts the next step of ``seq`` carries (0 unless it decodes one known token)."""
    if not seq.draft_ids or seq.num_tokens - seq.num_computed_tokens != 1 or budget < 2:
        return 0
    room = min(budget - 1, seq.sampling.max_tokens - seq.num_output_tokens - 1,
               max_model_len - seq.num_tokens)
    return max(0, min(len(seq.draft_ids), room))


def tokens_to_reserve(seq: Sequence, rows: int, drafts: int, lookahead: int) -> int:
    """Slots ``seq`` needs for a step of ``rows`` rows, ``drafts`` of them drafts: its
    rows, and when the step samples, the next proposal's ``lookahead`` positions."""
    end = seq.num_computed_tokens + rows
    samples = end - drafts == seq.num_tokens
    return end + (lookahead if samples else 0)
