"""Two-sided KV transfer pairs: ``transfer.staging`` (Mooncake) and ``transfer=nccl``.

Mooncake's direct path writes one-sided into registered caches; here the consumer takes
part, as in vLLM's P2P NCCL connector. One pair per (producer rank, consumer rank) that a
cut plan joins: the consumer rank listens on a socket (typed control messages,
``p2p_messages``); at pairing the producer says which source units it sends and how bytes
will move (``p2p_parts.choose_mover``):

- ``mooncake``: one Mooncake write per chunk into the consumer's registered host staging
  (GPU caches pack on the device and go through pinned host memory both ways); any host.
- ``nccl``: two GPUs of one host. NCCL send/recv in a two-rank process group made for the
  pair (a ``FileStore`` rendezvous).
- ``ipc``: one GPU shared by both ranks (NCCL refuses two ranks on one device). The
  consumer's receive buffer is mapped into the producer through CUDA IPC (or, both ranks
  in one process, handed over as it is: ``p2p_parts.IN_PROCESS``).
- ``peer`` (``transfer.peer_writes``, GPUs of one host that can reach each other's memory,
  or one GPU): the consumer's caches are mapped into the producer through CUDA IPC and one
  ``copy_runs`` launch per request writes every cut run from the producer's caches into
  them (NVLink between two GPUs): no receive buffer, no pack, no scatter.
- ``gloo``: ``transfer=nccl`` with CPU caches (what the tests on a laptop run).

Per request the producer packs the runs its cut plan names for that consumer rank
(``packing``'s order, so every path leaves identical caches; on a GPU one ``copy_plan``
launch per chunk, computing the chunk's runs in the kernel from the block ids), moves them
in chunks of
the consumer's receive buffer, and waits for the consumer's word that it scattered the
bytes into its caches: when ``send`` returns the KV is in place, as after a one-sided
write, and the engine's path does not change. Over a process group (``nccl``, ``gloo``)
that word is an 8-byte verdict on the group itself, in stream order after the last
scatter (an error's text follows on the socket); the other movers ack on the socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from pdflow.graph import CutPlan
from pdflow.spec.transfer import TransferSpec
from pdflow.transfer.descriptors import Descriptors
from pdflow.transfer.errors import TransferError
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.p2p_listener import P2PListener  # the consumer's end, re-exported
from pdflow.transfer.p2p_messages import FramedSocket, P2PAck, P2PChunk, P2PHello, P2PReady, P2PRequest
from pdflow.transfer.p2p_parts import (
    IN_PROCESS,
    GroupDeadline,
    Phases,
    abort_group,
    bad_blocks,
    choose_mover,
    chunks,
    copy_chunk,
    device_identity,
    enable_peer_access,
    local_device,
    map_cache,
    map_ipc,
    mooncake_staging,
    pair_group,
    pool_blocks,
    request_chunks,
    size_of,
    synchronize,
    two_halves,
)
from pdflow.transfer.packing import Piece, packed_nbytes
from pdflow.transfer.run_table import RunTable, direct_rows

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
        self.host_base = None  # mooncake: this side's registered host staging
        self._pair()
        if self.table is not None:  # the first request must not wait on Triton
            self.table.compile_copies(reverse=False, programs=self.copy_programs, direct=self.mover == "peer")

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
        try:
            self._set_up(ready)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """A set-up that failed part way (a mapping, a registration, a group: a
        ``TransferError`` or any other error): the consumer's session sees the connection
        close, and nothing made for the pair stays held."""
        self.conn.close()
        abort_group(self.group)
        if self.host_base is not None:
            self.transport.unregister(self.host_base)
            self.host_base = None
        self.buf = self.group = None

    def _set_up(self, ready: P2PReady) -> None:
        """The way this pair's bytes move, from the consumer's answer."""
        self.buffer_bytes = ready.buffer_bytes
        self.dst_table, self.group = None, None
        if self.mover == "peer":  # the consumer's caches, mapped here; written by one kernel per request
            enable_peer_access(self.device, local_device(self.consumer_device))
            self._mapped: dict[tuple, torch.Tensor] = {}
            # Opened in this GPU's context (CUDA IPC then maps the memory for this device's
            # kernels, over NVLink when it lives on another GPU).
            self.dst_caches = (self._in_process(ready.in_process) if ready.in_process else
                               {n: map_cache(m, self.device, self._mapped) for n, m in ready.caches.items()})
            self.dst_table = RunTable(self.plan, self.dst_caches, "dst", device=self.device)
            self.dst_pool = pool_blocks(self.plan, self.dst_caches)
            self.buf = None
        elif self.mover == "ipc":
            self.buf = self._in_process(ready.in_process) if ready.in_process else map_ipc(ready.ipc, self.device)
        elif self.mover == "mooncake":  # pack (on the GPU), to host, one write into the consumer's buffer
            self.host, self.host_base, self.buf = mooncake_staging(self.buffer_bytes, self.device, self.transport)
            self.remote = (ready.session, ready.base)
        else:
            self.buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
            self.group = pair_group(self.mover, ready.store_path, 1, self.timeout_s,
                                    self.buf[:self.buffer_bytes // 2])
            self.halves = two_halves(self.buf)  # ``_stream``'s two slots
            # The consumer's verdict on each request (``_verdict``), and its host copy.
            self.verdict = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.verdict_host = self.verdict if self.device.type != "cuda" else torch.zeros(
                1, dtype=torch.int64, pin_memory=True)
            self.verdict_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.deadline = GroupDeadline(self.group, self.conn.sock)
        self._sending: list = [None, None]  # the last send out of each half of ``buf``

    def _in_process(self, key: str):
        """What the consumer rank of this process handed over under ``key``."""
        value = IN_PROCESS.get(key)
        if value is None:
            raise TransferError(f"consumer rank at {self.address} ended its session before this rank took its "
                                "memory")
        return value

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int) -> None:
        """Move one request's runs into the consumer's ``dst_blocks`` (``nonce``: the consumer
        owner's grant of them); returns once they are in its caches. A failure of the pair itself (a dead or stalled peer, a collective
        error) leaves it broken until it pairs again (``_pair_again``)."""
        with self._lock:
            if self.broken:
                self._pair_again()
            try:
                self._send(src_blocks, dst_blocks, request_id, nonce)
            except TransferError:
                raise
            except Exception as err:  # a dead peer, a timeout, a collective error
                self.broken = f"{type(err).__name__}: {err}"
                abort_group(self.group)
                self._repair_at = time.monotonic() + self._repair_wait
                raise TransferError(self.broken) from err

    def _pair_again(self) -> None:
        """A broken pair pairs again, on a request's path, once its wait is over (the first
        ``REPAIR_WAIT_S[0]`` after it broke, doubling after each failed attempt up to
        ``REPAIR_WAIT_S[1]``): a consumer rank that stalled for a while serves again
        without restarting this rank, and one that is gone costs each request in between
        nothing but a refusal. Raises ``TransferError`` when the pair stays broken."""
        now = time.monotonic()
        if now < self._repair_at:
            raise TransferError(f"the pair is broken: {self.broken} (pairing again in "
                                f"{self._repair_at - now:.1f} s)")
        self._release()  # the consumer's end sees its connection close and ends that session
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

    def _send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int) -> None:
        limit = self.source_blocks
        if any(not 0 <= b < limit for b in src_blocks) or len(src_blocks) != len(dst_blocks):
            raise TransferError(f"source blocks {list(src_blocks)} (pool of {limit}) do not pair with "
                                f"{len(dst_blocks)} consumer blocks")
        phases = Phases(f"send {self.mover}", self.device)
        if self.mover == "peer":
            self._write_direct(src_blocks, dst_blocks, request_id, nonce, phases)
            return
        # The request first: the consumer posts its first receive while this rank packs.
        self.conn.send(P2PRequest(request_id=request_id, dst_blocks=list(dst_blocks), nonce=nonce))
        phases.mark("request")
        ids = self.table.ids(src_blocks) if self.table is not None else None  # what copy_plan reads
        phases.mark("ids")
        if self.group is not None:  # two halves: pack chunk i+1 while chunk i is on the wire
            self._stream(src_blocks, ids, request_id, phases)
            return
        # ipc, mooncake: into the consumer's own buffer, a chunk at a time, each acked
        parts = self._chunks(len(src_blocks), self.buffer_bytes, 0)
        for i, chunk in enumerate(parts):
            self._pack(chunk, self.buf, src_blocks, ids)
            synchronize(self.device)
            phases.mark("pack")
            if self.mover == "mooncake":
                self._write(size_of(chunk))
                phases.mark("write")
            self.conn.send(P2PChunk(index=i, nbytes=size_of(chunk)))
            if i + 1 < len(parts):
                self._ack(i)
                phases.mark("ack")
        self._ack(max(len(parts) - 1, 0))
        phases.mark("ack")
        phases.report()

    def _stream(self, src_blocks: Sequence[int], ids: torch.Tensor | None, request_id: str, phases: Phases) -> None:
        """Over the pair's group: pack chunk i+1 into one half of ``buf`` while chunk i is on
        the wire from the other, then wait for the consumer's verdict."""
        parts = self._chunks(len(src_blocks), self.buffer_bytes // 2, self.ramp)
        with self.deadline.armed(self.timeout_s) as aborted:  # a consumer that stalls or dies
            for i, chunk in enumerate(parts):
                if self._sending[i % 2] is not None:
                    self._sending[i % 2].wait()  # that half's last send left (NCCL: the stream waits)
                phases.mark("wait")
                self._pack(chunk, self.halves[i % 2], src_blocks, ids)
                phases.mark("pack")
                self._sending[i % 2] = self.group.send([self.halves[i % 2][:size_of(chunk)]], 0, 0)
                phases.mark("send")
            failed = self._verdict()
        if aborted():
            why = ("the consumer closed the pair's connection mid-request" if self.deadline.peer_left
                   else f"the consumer's verdict did not come within {self.timeout_s} s")
            raise ConnectionError(f"request {request_id!r}: {why}; the pair's group was aborted")
        self._sending = [None, None]  # the verdict came after every send of the request ended
        phases.mark("verdict")
        if failed:
            self._ack(max(len(parts) - 1, 0))  # its error, on the control socket
            raise ConnectionError(f"the consumer's verdict on request {request_id!r} was a failure, but its "
                                  "ack said none")
        phases.report()

    def _verdict(self) -> bool:
        """Wait for the consumer's 8-byte verdict on the pair's group (whether the request
        failed): sent in stream order after its last scatter, so no host step on its side
        and no socket on the path; a failure's text follows on the control socket. Waited
        for on a stream of its own: this rank's stream may already hold its next step's
        work. A stalled or dead consumer is the armed deadline's (``GroupDeadline``)."""
        with torch.cuda.stream(self.verdict_stream) if self.verdict_stream is not None else contextlib.nullcontext():
            self.group.recv([self.verdict], 0, 0).wait()
            if self.verdict_stream is not None:
                self.verdict_host.copy_(self.verdict, non_blocking=True)
                self.verdict_stream.synchronize()
        return bool(int(self.verdict_host[0]))

    def _write_direct(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int,
                      phases: Phases) -> None:
        """``peer``: every run from this rank's caches into the consumer's, one launch."""
        error = bad_blocks(dst_blocks, self.dst_pool)
        if error:  # checked here: a wild address would fault this GPU's context, or theirs
            raise TransferError(error)
        self.conn.send(P2PRequest(request_id=request_id, dst_blocks=list(dst_blocks), nonce=nonce))
        rows = direct_rows(self.table, src_blocks, self.dst_table, dst_blocks)
        phases.mark("rows")
        from pdflow.kernels.copy_runs import copy_runs  # GPU path only: loads Triton

        copy_runs(rows, self.table.max_words, programs=self.copy_programs)
        synchronize(self.device)  # in their caches once this returns: one-sided, no ack to wait for
        phases.mark("write")
        self.conn.send(P2PChunk(index=0, nbytes=packed_nbytes(self.plan, len(src_blocks))))
        phases.report()

    def _write(self, nbytes: int) -> None:
        if self.buf is not self.host:
            self.host[:nbytes].copy_(self.buf[:nbytes])  # device to host, synchronous
        session, base = self.remote
        try:
            self.transport.write(session, Descriptors(src=[self.host_base], dst=[base], length=[nbytes]))
        except TransferError as err:  # the consumer waits for this chunk's note: the pair's protocol is lost
            raise ConnectionError(f"the Mooncake write into the consumer's staging failed: {err}") from err

    def _pack(self, chunk: list[Piece], out: torch.Tensor, src_blocks: Sequence[int],
              ids: torch.Tensor | None) -> None:
        copy_chunk(chunk, out, src_blocks, plan=self.plan, caches=self.caches, other_block_bytes=self.dst_block_bytes,
                   reverse=False, table=self.table, ids=ids, programs=self.copy_programs)

    def _ack(self, index: int) -> None:
        ack = self.conn.recv()
        if not isinstance(ack, P2PAck) or ack.index != index:
            raise ConnectionError(f"expected the ack of chunk {index}, got {ack}")
        if ack.error:
            raise TransferError(f"consumer failed the request: {ack.error}")

    def close(self) -> None:
        self._release()  # not under the lock: a send in flight fails at once on the closed socket

    def _release(self) -> None:
        """Let go of the pair's connection and everything made for it (a closed or a
        re-paired pair)."""
        self.deadline.close()
        self.conn.close()
        if self.host_base is not None:
            self.transport.unregister(self.host_base)
            self.host_base = None
        self.buf = self.group = None
        self.dst_caches, self._mapped, self.dst_table = {}, {}, None
