"""Control messages a rank answers between steps (the same code in process and per rank):
open its KV link (register the pool with the transfer engine), pair with consumers and
forget them. Pairing one more consumer leaves the sender running: exports to the others
go on. Re-pairing or forgetting one closes its peers, so its exports in flight settle
first (``KVSender.close_consumer``); the other consumers' go on meanwhile, and the rank
waits for none of theirs."""

from __future__ import annotations

from pdflow.graph import RunGraph
from pdflow.parallel.messages import (
    ControlMessage,
    ForgetConsumer,
    Forgot,
    KVLinkOpened,
    Message,
    OpenKVLink,
    PairConsumer,
    Paired,
    RefusalInfo,
)
from pdflow.transfer.errors import PairingRefused
from pdflow.worker.kv_link import KVLink
from pdflow.worker.stage import Stage


def handle_control(stage: Stage, graph: RunGraph, role: str, rank: int, msg: ControlMessage) -> Message:
    if stage.link is None:  # a producer's sources are registered too, as the engine wants
        stage.link = KVLink(graph, role, rank, stage.kv_caches())
    if isinstance(msg, OpenKVLink):
        return KVLinkOpened(endpoint=stage.link.open(msg.key))
    if isinstance(msg, PairConsumer):
        if stage.link.paired(msg.consumer):  # its old peers close: its exports in flight settle first
            stage.close_consumer(msg.consumer)
        try:
            stage.link.pair(msg.endpoints, msg.consumer)
        except PairingRefused as err:
            return Paired(rank=rank, refusals=[RefusalInfo(code=str(r.code), message=r.message, fix=r.fix)
                                               for r in err.refusals])
        return Paired(rank=rank)
    if isinstance(msg, ForgetConsumer):
        held = stage.link.paired(msg.consumer)
        if held:  # its peers close: its exports in flight settle first
            stage.close_consumer(msg.consumer)
            stage.link.forget(msg.consumer)
        return Forgot(rank=rank, held=held)
    raise TypeError(f"rank {rank} cannot handle {type(msg).__name__}")
