"""A minimal rank body for launcher tests: joins the process group, then all-reduces
once per step, so a dead peer leaves the others blocked inside a collective."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pdflow.parallel.launcher import Channel, RankContext
from pdflow.parallel.messages import RankReady, Shutdown, StepInput, StepOutput
from pdflow.parallel.rendezvous import join_process_group


def alive(pid: int) -> bool:
    """Whether a process still exists (a zombie not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def allreduce_rank(ctx: RankContext, channel: Channel) -> None:
    join_process_group(ctx.store, "gloo", ctx.rank, ctx.world_size, 600)
    channel.send(RankReady(rank=ctx.rank, pid=os.getpid(), num_kv_blocks=0))
    while True:
        msg = channel.recv()
        if isinstance(msg, Shutdown):
            break
        assert isinstance(msg, StepInput)
        value = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(value)
        if ctx.rank == 0:
            channel.send(StepOutput(step=msg.step, token_ids=[int(value.item())], logprobs=[0.0]))
    dist.destroy_process_group()


def raising_rank(ctx: RankContext, channel: Channel) -> None:
    if ctx.rank == 1:
        raise ValueError("weights for layer 3 are missing")
    allreduce_rank(ctx, channel)


def report_birth_rank(ctx: RankContext, channel: Channel) -> None:
    """Fail on purpose, naming what the rank was born with: the launcher's error carries it."""
    raise RuntimeError(f"probe={os.environ.get('PDFLOW_PROBE')} cwd={os.getcwd()} parent={os.getppid()}")
