"""Two-sided KV transfer pairs (``transfer.staging`` and ``transfer=nccl``): the consumer
takes part, as in vLLM's P2P NCCL connector. One pair per (producer rank, consumer rank)
that a cut plan joins: the consumer rank listens (``p2p_listener``); at pairing the
producer says which source units it sends and how bytes move (a mover under ``movers/``).
Per request the producer packs its runs in ``packing``'s order, moves them in chunks of
the consumer's receive buffer, and waits for its word that they are scattered: when
``send`` returns the KV is in place, as after a one-sided write. This end keeps
connecting, the pair's lock and deadline, and breaking and pairing again.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from pdflow.graph import CutPlan
from pdflow.spec.transfer import TransferSpec
from pdflow.transfer.errors import TransferError
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.movers import MOVERS, Sender
from pdflow.transfer.p2p_listener import P2PListener  # the consumer's end, re-exported
from pdflow.transfer.p2p_messages import FramedSocket, P2PHello, P2PReady
from pdflow.transfer.p2p_parts import (
    GroupDeadline,
    Phases,
    abort_group,
    choose_mover,
    chunks,
    device_identity,
    request_chunks,
)
from pdflow.transfer.run_table import RunTable

__all__ = ["P2PListener", "P2PPeer", "chunks", "device_identity"]

# A broken pair's wait before it pairs again, doubling after each failed attempt (seconds).
REPAIR_WAIT_S = (1.0, 60.0)


class P2PPeer:
    """A producer rank's pair with one consumer rank."""

    def __init__(self, *, address: str, pairing: str, consumer_device: str, plan: CutPlan, caches: Mapping[str, torch.Tensor],
                 dst_block_bytes: Mapping[str, int], producer_rank: int, spec: TransferSpec,
                 transport: MooncakeTransport | None = None):
        self.plan, self.caches, self.dst_block_bytes = plan, caches, dst_block_bytes
        self.address, self.consumer_device, self.producer_rank = address, consumer_device, producer_rank
        self.pairing = pairing  # the consumer's token (its endpoint's): its listener refuses a hello without it
        self.source_blocks = min(caches[s].shape[0] for g in plan.groups for s, _ in g.units)
        self.device = next(iter(caches.values())).device
        self.transport = transport
        self.mover = choose_mover(device_identity(self.device), consumer_device,
                                  "mooncake" if transport is not None else "nccl", spec.peer_writes)
        self.broken = ""
        self.ramp, self.copy_programs, self.timeout_s = spec.chunk_ramp, spec.copy_programs, spec.timeout_s
        self.repairs = 0  # times this pair was broken and paired again
        self._repair_wait, self._repair_at = REPAIR_WAIT_S[0], 0.0
        self._chunks = request_chunks(plan)
        self._lock = threading.Lock()
        # On a GPU one copy_plan launch packs a chunk from the plan and the block ids; on CPU, torch index ops.
        self.table = RunTable(plan, caches, "src") if self.device.type == "cuda" else None
        self._pair()
        if self.table is not None:  # the first request must not wait on Triton
            self.table.compile_copies(reverse=False, programs=self.copy_programs, direct=self.sender.direct)

    def _pair(self) -> None:
        """Connect to the consumer rank and set the pair up (its hello, its answer, the way
        bytes move); a refusal or a consumer that does not answer is a ``TransferError``."""
        host, port = self.address.rsplit(":", 1)
        try:
            self.conn = FramedSocket(socket.create_connection((host, int(port)), timeout=self.timeout_s))
        except OSError as err:
            raise TransferError(f"consumer rank at {self.address} cannot be reached: {err}") from err
        sources = sorted({s for g in self.plan.groups for s, _ in g.units})
        try:
            self.conn.send(P2PHello(producer_rank=self.producer_rank, units=sources, mover=self.mover,
                                    pairing=self.pairing, pid=os.getpid()))
            ready = self.conn.recv()
        except (ConnectionError, OSError) as err:
            self.conn.close()
            raise TransferError(f"consumer rank at {self.address} closed the pairing connection before answering "
                                f"({err}): its process may have died (see its log)") from err
        if not isinstance(ready, P2PReady) or ready.refused:
            self.conn.close()
            why = ready.refused if isinstance(ready, P2PReady) else f"answered {type(ready).__name__}"
            raise TransferError(f"consumer at {self.address} refused the pair: {why}")
        self.sender: Sender = MOVERS[self.mover][0](self)  # the way this pair's bytes move
        try:
            self.sender.set_up(ready)
        except BaseException:  # the consumer's session sees the connection close; nothing stays held
            self.conn.close()
            abort_group(self.sender.group)
            self.sender.release()
            raise
        self.deadline = GroupDeadline(self.sender.group, self.conn.sock)

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int) -> None:
        """Move one request's runs into the consumer's ``dst_blocks`` (``nonce``: the consumer
        owner's grant of them); returns once they are in its caches. A failure of the pair
        itself (a dead or stalled peer, a collective error) leaves it broken until it pairs
        again (``_pair_again``)."""
        with self._lock:
            if self.broken:
                self._pair_again()
            if any(not 0 <= b < self.source_blocks for b in src_blocks) or len(src_blocks) != len(dst_blocks):
                raise TransferError(f"source blocks {list(src_blocks)} (pool of {self.source_blocks}) do not pair "
                                    f"with {len(dst_blocks)} consumer blocks")
            try:
                self.sender.send(src_blocks, dst_blocks, request_id, nonce, Phases(f"send {self.mover}", self.device))
            except TransferError:
                raise
            except Exception as err:  # a dead peer, a timeout, a collective error
                self.broken = f"{type(err).__name__}: {err}"
                abort_group(self.sender.group)
                self._repair_at = time.monotonic() + self._repair_wait
                raise TransferError(self.broken) from err

    def _pair_again(self) -> None:
        """A broken pair pairs again on a request's path once its wait (``REPAIR_WAIT_S``)
        is over: a consumer rank that stalled serves again without restarting this rank,
        and one that is gone costs each request in between only a refusal. Raises
        ``TransferError`` when the pair stays broken."""
        now = time.monotonic()
        if now < self._repair_at:
            raise TransferError(f"the pair is broken: {self.broken} (pairing again in "
                                f"{self._repair_at - now:.1f} s)")
        self.close()  # the consumer's end sees its connection close and ends that session
        try:
            self._pair()
        except Exception as err:  # refused, unreachable, or a mapping or registration that failed
            self._repair_wait = min(2 * self._repair_wait, REPAIR_WAIT_S[1])
            self._repair_at = time.monotonic() + self._repair_wait
            raise TransferError(f"the pair is broken: {self.broken}; pairing again failed: {err}") from err
        print(f"p2p: producer rank {self.producer_rank} paired again with the consumer rank at {self.address} "
              f"(the pair broke: {self.broken})", file=sys.stderr, flush=True)
        self.broken, self._repair_wait = "", REPAIR_WAIT_S[0]
        self.repairs += 1

    def close(self) -> None:
        """Let go of the pair's connection and everything made for it. Not under the lock:
        a send in flight fails at once on the closed socket."""
        self.deadline.close()
        self.conn.close()
        self.sender.release()
