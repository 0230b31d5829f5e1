"""Acceptance statistics: definitions, per-position counts, merging, the wire form."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from pdflow.spec_decode import stats as S
from pdflow.spec_decode.verify import verify


def test_rates_follow_their_definitions():
    st = S.AcceptanceStats()
    st.record(7, 3)
    st.record(7, 7)
    st.record(4, 0)
    assert (st.verify_steps, st.proposed, st.accepted) == (3, 18, 10)
    assert st.acceptance_rate == pytest.approx(10 / 18)
    assert st.tokens_per_forward == pytest.approx((10 + 3) / 3)
    assert st.proposed_at == [3, 3, 3, 3, 2, 2, 2]
    assert st.accepted_at == [2, 2, 2, 1, 1, 1, 1]
    assert st.rate_at[0] == pytest.approx(2 / 3) and st.rate_at[4] == pytest.approx(1 / 2)


def test_impossible_steps_are_refused():
    with pytest.raises(ValueError):
        S.AcceptanceStats().record(3, 4)


def test_merging_parts_equals_recording_everything_in_one():
    rng = random.Random(0)
    steps = [(rng.randint(0, 7), None) for _ in range(300)]
    steps = [(n, rng.randint(0, n)) for n, _ in steps]
    whole = S.AcceptanceStats()
    parts = [S.AcceptanceStats() for _ in range(5)]
    for i, (n, a) in enumerate(steps):
        whole.record(n, a)
        parts[i % 5].record(n, a)
    assert S.AcceptanceStats.merge_all(parts) == whole
    # The order of merging does not matter.
    assert S.AcceptanceStats.merge_all(reversed(parts)) == whole


def test_wire_round_trip():
    st = S.AcceptanceStats()
    st.record(5, 2)
    assert S.decode(S.encode(st)) == st
    with pytest.raises(msgspec.ValidationError):
        S.decode(msgspec.msgpack.encode({"verify_steps": "many"}))


def test_tracker_records_verify_results_per_request():
    gen = torch.Generator().manual_seed(0)
    tracker = S.AcceptanceTracker()
    for _ in range(4):
        logits = torch.randn(3, 4, 3, generator=gen)
        drafts = torch.randint(0, 3, (3, 3), generator=gen)
        result = verify(logits, drafts, num_drafts=torch.tensor([3, 2, 0]))
        tracker.record(["a", "b", "c"], result.num_drafts.tolist(), result.num_accepted.tolist())
    a = tracker.requests["a"]
    assert a.verify_steps == 4 and a.proposed == 12
    assert tracker.requests["c"].proposed == 0 and tracker.requests["c"].tokens_per_forward == 1.0
    before = tracker.total()
    popped = tracker.pop("a")
    assert popped == a and "a" not in tracker.requests
    assert tracker.total() == before
