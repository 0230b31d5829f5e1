"""Lanes: jobs run off the caller's thread, one queue per peer, and every future is
settled by its deadline even when its job never returns."""

from __future__ import annotations

import threading
import time

import pytest

from pdflow.transfer.errors import TransferError
from pdflow.transfer.lanes import Lanes


@pytest.fixture
def lanes():
    lanes = Lanes()
    yield lanes
    lanes.close()


def test_a_result_comes_back_from_the_lane(lanes):
    caller = threading.get_ident()
    future = lanes.submit("peer", lambda deadline: (threading.get_ident(), deadline), deadline=time.monotonic() + 5)
    ident, deadline = future.result(timeout=5)
    assert ident != caller and deadline > time.monotonic()


def test_a_stuck_job_fails_at_its_deadline_and_the_jobs_behind_it_never_start(lanes):
    release, started = threading.Event(), []
    stuck = lanes.submit("peer", lambda d: release.wait(30), deadline=time.monotonic() + 0.3)
    behind = lanes.submit("peer", lambda d: started.append(1), deadline=time.monotonic() + 0.3)
    other = lanes.submit("other", lambda d: "free", deadline=time.monotonic() + 5)
    assert other.result(timeout=5) == "free"  # another peer's lane is not held up
    with pytest.raises(TransferError, match="deadline"):
        stuck.result(timeout=5)
    with pytest.raises(TransferError, match="deadline"):
        behind.result(timeout=5)
    release.set()
    late = lanes.submit("peer", lambda d: "after", deadline=time.monotonic() + 5)
    assert late.result(timeout=5) == "after" and started == []


def test_a_job_error_reaches_the_waiter(lanes):
    def boom(deadline):
        raise TransferError("rejected")

    with pytest.raises(TransferError, match="rejected"):
        lanes.submit("peer", boom, deadline=time.monotonic() + 5).result(timeout=5)


def test_a_closed_lane_set_takes_no_jobs():
    lanes = Lanes()
    lanes.close()
    with pytest.raises(TransferError, match="closed"):
        lanes.submit("peer", lambda d: None, deadline=time.monotonic() + 1)


def test_a_callback_of_an_expired_job_may_submit_the_next(lanes):
    """The watchdog settles futures outside its lock, so a done-callback can queue more work."""
    release, follow = threading.Event(), []
    stuck = lanes.submit("peer", lambda d: release.wait(30), deadline=time.monotonic() + 0.2)
    stuck.add_done_callback(lambda f: follow.append(
        lanes.submit("other", lambda d: "next", deadline=time.monotonic() + 5)))
    with pytest.raises(TransferError):
        stuck.result(timeout=5)
    release.set()
    deadline = time.monotonic() + 5
    while not follow and time.monotonic() < deadline:
        time.sleep(0.01)
    assert follow[0].result(timeout=5) == "next"
