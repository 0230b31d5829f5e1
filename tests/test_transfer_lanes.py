"""Lanes: jobs run off the caller's thread, one queue per peer, and every caller has its
answer by its deadline even when its job never returns."""

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
    ident, deadline = lanes.run("peer", lambda deadline: (threading.get_ident(), deadline),
                                deadline=time.monotonic() + 5)
    assert ident != caller and deadline > time.monotonic()


def test_a_stuck_job_fails_at_its_deadline_and_the_jobs_behind_it_never_start(lanes):
    release, entered, started, errors = threading.Event(), threading.Event(), [], []

    def stuck(deadline):
        entered.set()
        release.wait(30)

    def wait_for(job):
        try:
            lanes.run("peer", job, deadline=time.monotonic() + 0.3)
        except TransferError as err:
            errors.append(str(err))

    callers = [threading.Thread(target=wait_for, args=(job,)) for job in (stuck, lambda d: started.append(1))]
    callers[0].start()
    assert entered.wait(5)
    callers[1].start()  # queued behind the stuck job
    assert lanes.run("other", lambda d: "free", deadline=time.monotonic() + 5) == "free"  # not held up
    for caller in callers:
        caller.join(5)
    assert len(errors) == 2 and all("deadline" in e for e in errors)
    release.set()
    assert lanes.run("peer", lambda d: "after", deadline=time.monotonic() + 5) == "after" and started == []


def test_a_job_error_reaches_the_waiter(lanes):
    def boom(deadline):
        raise TransferError("rejected")

    with pytest.raises(TransferError, match="rejected"):
        lanes.run("peer", boom, deadline=time.monotonic() + 5)


def test_a_closed_lane_set_takes_no_jobs():
    lanes = Lanes()
    lanes.close()
    with pytest.raises(TransferError, match="closed"):
        lanes.run("peer", lambda d: None, deadline=time.monotonic() + 1)
