"""Ranks forked from the warm zygote are born as a fresh interpreter's would be: with the
owner's environment and working directory at launch time (not the zygote's), and a dead
zygote takes its ranks down with an error instead of a hang. ``PDFLOW_RANK_START=spawn``
starts each rank as its own interpreter."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from parallel_probe import alive

from pdflow.parallel import zygote
from pdflow.parallel.launcher import LocalLauncher, RankFailed
from pdflow.spec.load import compose_spec

pytestmark = pytest.mark.skipif(not zygote.usable(), reason="no pidfds or descriptor passing here")


def launcher(target: str, world: int = 2) -> LocalLauncher:
    spec = compose_spec(["decode.ready_timeout_s=60"])
    return LocalLauncher(spec, "decode", f"parallel_probe:{target}", [f"decode.s0.t{r}" for r in range(world)])


def birth(monkeypatch, tmp_path, value: str) -> dict[str, str]:
    monkeypatch.setenv("PDFLOW_PROBE", value)
    monkeypatch.chdir(tmp_path)
    inst = launcher("report_birth_rank")
    assert inst.use_zygote == (os.environ.get("PDFLOW_RANK_START") != "spawn")
    with pytest.raises(RankFailed) as failed:
        inst.start()
    return dict(re.findall(r"(probe|cwd|parent)=(\S+)", str(failed.value)))


def test_a_forked_rank_gets_the_owners_environment_and_cwd_at_launch(monkeypatch, tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = birth(monkeypatch, tmp_path / "a", "one")
    second = birth(monkeypatch, tmp_path / "b", "two")
    assert (first["probe"], first["cwd"]) == ("one", str(tmp_path / "a"))
    assert (second["probe"], second["cwd"]) == ("two", str(tmp_path / "b"))
    # Both forked by the same warm zygote, not by this process.
    assert first["parent"] == second["parent"] != str(os.getpid())


def test_spawn_opt_out_starts_ranks_as_children_of_the_owner(monkeypatch, tmp_path):
    monkeypatch.setenv("PDFLOW_RANK_START", "spawn")
    got = birth(monkeypatch, tmp_path, "spawned")
    assert (got["probe"], got["parent"]) == ("spawned", str(os.getpid()))


@pytest.mark.slow
def test_a_killed_zygote_fails_the_instance_and_leaves_no_rank(monkeypatch):
    monkeypatch.delenv("PDFLOW_RANK_START", raising=False)
    inst = launcher("allreduce_rank")
    inst.start()
    pids = inst.pids
    os.kill(zygote._shared.proc.pid, signal.SIGKILL)
    with pytest.raises(RankFailed, match=r"decode\.s0\.t\d"):
        for _ in range(40):  # the ranks notice their parent is gone within a second
            inst.check()
            time.sleep(0.25)
    assert not any(alive(p) for p in pids)
    # The next instance gets a new zygote.
    again = launcher("allreduce_rank")
    again.start()
    again.shutdown()
