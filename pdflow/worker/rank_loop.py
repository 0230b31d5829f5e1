"""The body of one rank process: join the instance's process groups, build the stage,
then run every StepInput the owner sends until it says Shutdown.

Hidden states, and the drafter taps captured so far, go stage to stage over
torch.distributed; the last stage samples and its first TP rank answers the owner. A
producer rank hands a step's KV exports to its sender after the step's PP send and
answers ``KVSent`` from the sender's threads (one per consumer instance) whenever they
settle.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pdflow.attention.kv_cache import TORCH_DTYPES
from pdflow.graph import build_graph, parallel_of
from pdflow.model.layers import set_tp_group
from pdflow.parallel.groups import topology, tp_group_ranks
from pdflow.parallel.launcher import Channel, RankContext
from pdflow.parallel.messages import ControlMessage, RankReady, Shutdown, StepInput
from pdflow.parallel.rendezvous import join_process_group
from pdflow.worker.control import handle_control
from pdflow.worker.stage import build_stage, rank_device


def serve_rank(ctx: RankContext, channel: Channel) -> None:
    spec, role = ctx.spec, ctx.role
    graph = build_graph(spec, ctx.devices).raise_if_refused()
    plan = graph.instance(role)
    me = plan.ranks[ctx.rank]
    topo = topology(plan, me)
    par = parallel_of(spec, role)
    device = rank_device(par, me)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Ranks of a 2-core CPU machine share it; one thread each avoids oversubscription.
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    join_process_group(ctx.store, "nccl" if device.type == "cuda" else "gloo", ctx.rank, ctx.world_size,
                       par.step_timeout_s)
    mine = None
    for ranks in tp_group_ranks(plan):  # every rank creates every group, in one order
        group = dist.new_group(list(ranks))
        if me.rank in ranks:
            mine = group
    set_tp_group(mine if par.tp > 1 else None)

    stage = build_stage(graph, role, ctx.rank, device)
    warm_up_s = stage.warm_up(announce=f"{role} instance" if ctx.rank == 0 else None)
    hidden_size, dtype = stage.config.hidden_size, TORCH_DTYPES[spec.model.dtype]
    relayed_in = len(plan.stages[me.stage - 1].taps_relayed) if me.stage > 0 else 0
    relays_out = bool(plan.stages[me.stage].taps_relayed)
    channel.send(RankReady(rank=ctx.rank, pid=os.getpid(), num_kv_blocks=stage.kv.num_blocks,
                           warm_up_s=warm_up_s))
    stage.report_sent = channel.send  # the sender's threads report settled exports (KVSent)

    with torch.inference_mode():
        while True:
            msg = channel.recv()
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, ControlMessage):
                channel.send(handle_control(stage, graph, role, ctx.rank, msg))
                continue
            if not isinstance(msg, StepInput):
                raise TypeError(f"rank {me.label} got {type(msg).__name__}, expected StepInput")
            drafted = stage.replay_drafted(msg)  # a whole model's steady drafted step, graphed
            if drafted is not None:
                if topo.is_driver:
                    channel.send(stage.answer(msg, None, None, True, drafted))
                continue
            runner = stage.runner
            ids, positions, meta = runner.tensors(msg)
            taps_in = None
            if topo.is_first_stage:
                inputs = ids
            else:
                inputs = torch.empty(len(msg.token_ids), hidden_size, dtype=dtype, device=device)
                dist.recv(inputs, src=topo.prev_rank)
                if relayed_in:
                    taps_in = torch.empty(len(msg.token_ids), relayed_in * hidden_size,
                                          dtype=dtype, device=device)
                    dist.recv(taps_in, src=topo.prev_rank)
            hidden, taps, graphed = stage.forward(inputs, positions, meta, taps_in)
            # The drafter writes its units before they are exported (None: no drafter here).
            drafted = stage.draft(msg, ids, positions, meta, hidden, taps)
            if not topo.is_last_stage:
                dist.send(hidden.contiguous(), dst=topo.next_rank)
                if relays_out:
                    dist.send(taps.contiguous(), dst=topo.next_rank)
                if msg.exports:  # off the forward: the next stage already has its input
                    stage.export(msg.exports)
                continue
            if msg.exports:  # this stage's layers of the finished prompts are written (enqueued)
                stage.export(msg.exports)
            # Every TP rank joins the vocab all-gather (the drafter's verify did it already).
            logits = runner.logits(msg, hidden) if drafted is None else None
            prompt = stage.score_prompts(msg, hidden)
            if topo.is_driver:
                channel.send(stage.answer(msg, logits, taps, graphed, drafted, prompt))
    stage.release()
    dist.destroy_process_group()
