"""How a ``transfer.p2p`` pair's bytes move: the movers, by the name
``p2p_parts.choose_mover`` picks at pairing (the protocol: ``movers.protocol``)."""

from __future__ import annotations

from pdflow.transfer.movers.group import GroupReceiver, GroupSender
from pdflow.transfer.movers.ipc import IpcReceiver, IpcSender
from pdflow.transfer.movers.peer import PeerReceiver, PeerSender
from pdflow.transfer.movers.protocol import Receiver, Sender
from pdflow.transfer.movers.staged_mooncake import MooncakeReceiver, MooncakeSender

__all__ = ["MOVERS", "Receiver", "Sender"]

# name -> (the producer's half, the consumer's half)
MOVERS: dict[str, tuple[type[Sender], type[Receiver]]] = {
    "mooncake": (MooncakeSender, MooncakeReceiver),
    "gloo": (GroupSender, GroupReceiver),
    "nccl": (GroupSender, GroupReceiver),
    "ipc": (IpcSender, IpcReceiver),
    "peer": (PeerSender, PeerReceiver),
}
