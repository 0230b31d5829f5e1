"""Instances started side by side: every port is bound by its owner before anyone is
told it (no "probe a free port, close it, bind it later", which another process can
win in between: EADDRINUSE)."""

from __future__ import annotations

import errno
import socket
import threading

import pytest
from test_parallel_launcher import launcher, step

from pdflow.parallel.launcher import LocalLauncher
from pdflow.parallel.rendezvous import RendezvousError
from pdflow.spec.load import compose_spec


def taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            assert err.errno == errno.EADDRINUSE, err
            return True
    return False


@pytest.mark.slow
def test_the_rendezvous_listens_before_any_rank_is_started(monkeypatch):
    inst = launcher("allreduce_rank", world=2)
    seen = []
    start_process = LocalLauncher._start_process

    def checked(self, rank, fd):
        seen.append(taken(self.rendezvous.port))
        return start_process(self, rank, fd)

    monkeypatch.setattr(LocalLauncher, "_start_process", checked)
    try:
        inst.start()
        inst.send(0, step(0))
        inst.send(1, step(0))
        assert inst.recv(0, 60).token_ids == [3]  # 1 + 2: the ranks met there
    finally:
        inst.shutdown()
    assert seen == [True, True]
    assert inst.rendezvous is None


@pytest.mark.slow
def test_a_fixed_rendezvous_port_that_is_taken_fails_before_any_rank_starts():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        spec = compose_spec(["decode.ready_timeout_s=60", f"decode.master_port={port}"])
        inst = LocalLauncher(spec, "decode", "parallel_probe:allreduce_rank", ["decode.s0.t0", "decode.s0.t1"])
        with pytest.raises(RendezvousError, match=f"127.0.0.1:{port} .*master_port to 0"):
            inst.start()
        assert inst.pids == []


def serve_one(outs: dict, key: int) -> None:
    from pdflow import LLM, SamplingParams
    from pdflow.spec import ParallelSpec

    with LLM("pdflow:assets/tiny", ParallelSpec(tp=2)) as llm:
        out = llm.generate("Question: Mira has 12 apples.", SamplingParams(temperature=0, max_tokens=4))
        outs[key] = out[0].token_ids


@pytest.mark.slow
def test_several_instances_started_at_once_all_come_up_and_agree():
    """Three TP2 instances (six rank processes, three rendezvous stores) started at once
    from one owner, each from its own thread, as a server starting instances side by
    side does; every one comes up and serves the same greedy tokens."""
    outs: dict[int, list[int]] = {}
    errors = []

    def run(key: int) -> None:
        try:
            serve_one(outs, key)
        except BaseException as err:  # noqa: BLE001 - reported below, with its instance
            errors.append((key, repr(err)))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(outs) == 3 and outs[0] == outs[1] == outs[2] and len(outs[0]) == 4, outs
