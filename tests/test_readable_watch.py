"""``ReadableWatch`` on real socket pairs: it calls once a watched pipe turns readable
while armed, then stays quiet (a message the owner leaves unread must not make it spin)
until the owner re-arms it, and never calls while disarmed."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from pdflow.parallel.readable_watch import ReadableWatch

WAKE_WAIT_S = 20.0  # a liveness bound: a working watch calls within milliseconds
QUIET_S = 0.3  # how long a disarmed watch is watched for calls it must not make


@pytest.fixture
def pipes():
    pairs = [socket.socketpair() for _ in range(2)]
    ours = [Connection(a.detach()) for a, _ in pairs]
    theirs = [Connection(b.detach()) for _, b in pairs]
    yield ours, theirs
    for conn in ours + theirs:
        conn.close()


class Calls:
    def __init__(self):
        self.count, self.event = 0, threading.Event()

    def __call__(self):
        self.count += 1
        self.event.set()


def test_it_calls_once_per_arm_while_a_message_stays_unread(pipes):
    ours, theirs = pipes
    calls = Calls()
    watch = ReadableWatch(lambda: ours, calls)
    try:
        theirs[1].send_bytes(b"settled")
        time.sleep(QUIET_S)
        assert calls.count == 0  # not armed: the owner expects nothing
        watch.arm()
        assert calls.event.wait(WAKE_WAIT_S)
        time.sleep(QUIET_S)
        assert calls.count == 1  # the message is still unread: one call, no spin
        calls.event.clear()
        watch.arm()  # the owner re-arms without reading: still readable, so one more call
        assert calls.event.wait(WAKE_WAIT_S)
        assert ours[1].recv_bytes() == b"settled"
        calls.event.clear()
        watch.arm()
        time.sleep(QUIET_S)
        assert calls.count == 2  # armed, nothing to read
        theirs[0].send_bytes(b"next")
        assert calls.event.wait(WAKE_WAIT_S) and calls.count == 3
    finally:
        watch.close()


def test_a_disarmed_watch_does_not_call_and_close_ends_its_thread(pipes):
    ours, theirs = pipes
    calls = Calls()
    watch = ReadableWatch(lambda: ours, calls)
    watch.arm()
    watch.disarm()
    theirs[0].send_bytes(b"x")
    time.sleep(QUIET_S)
    assert calls.count == 0
    watch.arm()
    assert calls.event.wait(WAKE_WAIT_S)
    watch.close()
    assert not watch._thread.is_alive()


def test_a_handle_closed_under_it_neither_spins_the_watch_nor_keeps_it_past_close(pipes):
    """Closed while the watch waits on it, a handle either makes ``wait`` raise (the watch
    ends) or polls as readable once (one call, then disarmed): never a call per poll."""
    ours, _ = pipes
    calls = Calls()
    watch = ReadableWatch(lambda: ours, calls)
    watch.arm()
    ours[0].close()
    time.sleep(QUIET_S)
    assert calls.count <= 1
    watch.close()
    assert not watch._thread.is_alive()
