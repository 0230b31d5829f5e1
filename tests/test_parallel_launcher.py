"""The local launcher: readiness, typed messages, and faults that end the instance
(naming the rank) within a bounded time, leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from parallel_probe import alive

from pdflow.parallel.launcher import LocalLauncher, RankFailed, check_target
from pdflow.parallel.messages import SamplingSpec, StepInput
from pdflow.spec.load import compose_spec
from pdflow.worker.executors import RANK_TARGET


def step(n: int) -> StepInput:
    return StepInput(
        step=n,
        seq_ids=["r0"],
        token_ids=[1],
        positions=[0],
        slot_mapping=[0],
        cu_seqlens_q=[0, 1],
        context_lens=[1],
        block_tables=[[0]],
        sample_rows=[0],
        sample_seq_ids=["r0"],
        sampling=[SamplingSpec()],
    )


def launcher(target: str, world: int = 4) -> LocalLauncher:
    spec = compose_spec(["decode.ready_timeout_s=60"])
    return LocalLauncher(spec, "decode", f"parallel_probe:{target}", [f"decode.s0.t{r}" for r in range(world)])


def test_rank_target_is_an_importable_name():
    from pdflow.parallel.rank_entry import resolve_target
    from pdflow.worker.rank_loop import serve_rank

    assert resolve_target(RANK_TARGET) is serve_rank
    for bad, error in [(serve_rank, TypeError), ("pdflow.worker.rank_loop", ValueError),
                       ("__main__:serve", ValueError), ("pdflow:not a name", ValueError)]:
        with pytest.raises(error):
            check_target(bad)


@pytest.mark.slow
def test_ranks_answer_steps_and_shut_down_cleanly():
    inst = launcher("allreduce_rank")
    readies = inst.start()
    pids = inst.pids
    assert sorted(r.rank for r in readies) == [0, 1, 2, 3]
    for n in range(3):
        inst.broadcast(step(n))
        out = inst.recv(0, timeout_s=30)
        assert out.step == n and out.token_ids == [1 + 2 + 3 + 4]
    inst.shutdown()
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_killed_rank_fails_the_instance_naming_it_without_orphans():
    inst = launcher("allreduce_rank")
    inst.start()
    pids = inst.pids
    inst.broadcast(step(0))
    inst.recv(0, timeout_s=30)
    os.kill(pids[2], signal.SIGKILL)  # mid-run: the others block in the next all-reduce
    inst.broadcast(step(1))
    began = time.monotonic()
    with pytest.raises(RankFailed, match=r"decode\.s0\.t2"):
        inst.recv(0, timeout_s=120)
    assert time.monotonic() - began < 15
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_rank_that_raises_reports_its_traceback():
    inst = launcher("raising_rank", world=2)
    with pytest.raises(RankFailed, match=r"decode\.s0\.t1 failed: raised:(.|\n)*weights for layer 3"):
        inst.start()
    assert inst.pids == []


OWNER = """
import sys, time
sys.path.insert(0, {tests!r})
from pdflow.parallel.launcher import LocalLauncher
from pdflow.spec.load import compose_spec
spec = compose_spec(["decode.ready_timeout_s=60"])
inst = LocalLauncher(spec, "decode", "parallel_probe:allreduce_rank", ["decode.s0.t0", "decode.s0.t1"])
inst.start()
print(*inst.pids, flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_ranks_exit_when_their_owner_is_killed():
    code = OWNER.format(tests=str(Path(__file__).parent))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        owner.kill()
        owner.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
    finally:
        owner.kill()
        owner.wait(timeout=10)
