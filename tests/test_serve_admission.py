"""The admission room's rules on their own (no engine): reservations never exceed the
pool, arrivals are served in order, the room is bounded by length and by time."""

from __future__ import annotations

import pytest

from pdflow.serve.admission import Admission, AdmissionPolicy


def test_reservations_fit_the_pool_in_arrival_order_and_come_back():
    room = Admission(AdmissionPolicy(max_queued=8), num_blocks=6, block_size=16)
    a, b, c, d = "a", "b", "c", "d"
    assert room.need(15) == 1 and room.need(16) == 2 and room.need(10_000) == 6
    for item, n in ((a, 40), (b, 40), (c, 5), (d, 5)):  # 3, 3, 1, 1 blocks
        assert room.offer(item, n, now=0.0)
    assert room.ready() == [a, b] and room.reserved == 6
    assert room.ready() == []  # c would fit after a release, not before: no overtaking
    room.release(a)
    assert room.ready() == [c, d] and room.reserved == 5
    for item in (b, c, d):
        room.release(item)
    assert room.reserved == 0


def test_the_room_is_bounded_by_length_and_by_time():
    room = Admission(AdmissionPolicy(max_queued=2, queue_timeout_s=1.0), num_blocks=2, block_size=16)
    assert room.offer("running", 20, now=0.0) and room.ready() == ["running"]
    assert room.offer("w1", 20, now=0.0) and room.offer("w2", 20, now=0.5)
    assert not room.offer("w3", 1, now=0.6)  # full: refused at once, however small
    assert room.expired(now=0.9) == []
    assert room.expired(now=1.0) == ["w1"] and room.num_waiting == 1
    assert room.withdraw("w2") and not room.withdraw("w2") and room.num_waiting == 0
    room.release("running")
    assert room.reserved == 0 and room.drain() == []


def test_arrivals_that_fit_together_are_not_refused_by_a_full_room():
    """``max_queued=0`` refuses only what would have to wait: requests arriving in one
    batch (offered before the next ``ready``) that fit the pool together all get in; the
    one past the pool is refused (it was refused too while the first still waited)."""
    room = Admission(AdmissionPolicy(max_queued=0), num_blocks=6, block_size=16)
    assert room.offer("a", 40, now=0.0) and room.offer("b", 40, now=0.0)  # 3 + 3 blocks
    assert not room.offer("c", 5, now=0.0)
    assert room.ready() == ["a", "b"] and room.reserved == 6
    assert not room.offer("d", 5, now=0.0)
    room.release("a")
    assert room.offer("d", 5, now=0.0) and room.ready() == ["d"]


@pytest.mark.parametrize("role", ["role=prefill", "role=decode", "backends"])
def test_api_servers_on_a_role_without_fronts_is_refused_at_compose_time(role):
    """Not silently ignored: only role=deployment has API front processes."""
    from pdflow import compose
    from pdflow.spec.errors import ConfigError

    where = {"role=prefill": "serve.role=prefill", "role=decode": "serve.role=decode",
             "backends": "serve.backends=[http://127.0.0.1:9]"}[role]
    with pytest.raises(ConfigError, match="serves from one process"):
        compose([where, "serve.api_servers=2"])
    assert compose([where]).serve.api_servers == 1


def test_a_policy_that_makes_no_sense_is_refused():
    with pytest.raises(ValueError, match="queue_timeout_s"):
        AdmissionPolicy(queue_timeout_s=0)


def test_the_engine_core_leaves_the_api_fronts_their_cores():
    """On 2 cores a CPU engine core with 2 torch threads waited on whichever thread a front
    had preempted (decode steps 50% slower served than offline): by default it takes the
    cores less one per front; a number sets it; a negative one is refused."""
    from pdflow import compose
    from pdflow.spec.errors import ConfigError

    assert compose([]).serve.core_threads_on(2) == 1
    assert compose(["serve.api_servers=2"]).serve.core_threads_on(16) == 14
    assert compose(["serve.api_servers=2"]).serve.core_threads_on(2) == 1
    assert compose(["serve.core_threads=3"]).serve.core_threads_on(2) == 3
    with pytest.raises(ConfigError, match="core_threads"):
        compose(["serve.core_threads=-1"])


def test_a_separately_served_instance_takes_the_engine_cores_thread_count():
    """``role=prefill|decode`` step their engine on a thread beside their API thread, so they
    leave it a core as the engine core does (issue 33: a decode instance's local prefill
    took twice its CPU time in wall time with both cores given to torch)."""
    import torch

    from pdflow import compose
    from pdflow.serve.engine_threads import set_engine_threads

    before = torch.get_num_threads()
    try:
        assert set_engine_threads(compose(["serve.role=decode"]).serve, cores=2) == 1
        assert torch.get_num_threads() == 1
        assert set_engine_threads(compose(["serve.core_threads=2"]).serve, cores=2) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_api_key_check_runs_on_the_event_loop():
    """A plain-function dependency would run on FastAPI's thread pool: a thread hand-off on
    every request of the instances and the router."""
    import inspect

    from pdflow.serve.api import bearer_guard

    assert inspect.iscoroutinefunction(bearer_guard("key"))
    assert inspect.iscoroutinefunction(bearer_guard(None))
