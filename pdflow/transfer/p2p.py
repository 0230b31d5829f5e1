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
  consumer's receive buffer is mapped into the producer through CUDA IPC.
- ``peer`` (``transfer.peer_writes``, GPUs of one host that can reach each other's memory,
  or one GPU): the consumer's caches are mapped into the producer through CUDA IPC and one
  ``copy_runs`` launch per request writes every cut run from the producer's caches into
  them (NVLink between two GPUs): no receive buffer, no pack, no scatter.
- ``gloo``: ``transfer=nccl`` with CPU caches (what the tests on a laptop run).

Per request the producer packs the runs its cut plan names for that consumer rank
(``packing``'s order, so every path leaves identical caches; on a GPU one ``copy_runs``
launch per chunk, over rows built once per request on the device), moves them in chunks of
the consumer's receive buffer, and waits for the consumer's ack after it scattered the
bytes into its caches: when ``send`` returns the KV is in place, as after a one-sided
write, and the engine's path does not change.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Mapping, Sequence

import torch

from pdflow.graph import PRODUCER, CutPlan, RunGraph
from pdflow.spec.transfer import TransferSpec
from pdflow.transfer.descriptors import Descriptors
from pdflow.transfer.errors import TransferError
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.p2p_messages import FramedSocket, P2PAck, P2PChunk, P2PHello, P2PReady, P2PRequest
from pdflow.transfer.p2p_parts import (
    Phases,
    bad_blocks,
    bound_plan,
    choose_mover,
    chunks,
    device_identity,
    enable_peer_access,
    host_buffer,
    local_device,
    map_cache,
    map_ipc,
    pair_group,
    share_cache,
    share_ipc,
    side_stream,
    size_of,
    synchronize,
)
from pdflow.transfer.packing import Piece, pack_piece, packed_nbytes, unpack_piece
from pdflow.transfer.run_table import RunTable, direct_rows

__all__ = ["P2PListener", "P2PPeer", "bound_plan", "chunks", "device_identity"]


class P2PPeer:
    """A producer rank's pair with one consumer rank."""

    def __init__(self, *, address: str, consumer_device: str, plan: CutPlan, caches: Mapping[str, torch.Tensor],
                 dst_block_bytes: Mapping[str, int], producer_rank: int, spec: TransferSpec,
                 transport: MooncakeTransport | None = None):
        self.plan, self.caches, self.dst_block_bytes = plan, caches, dst_block_bytes
        self.source_blocks = min(caches[s].shape[0] for g in plan.groups for s, _ in g.units)
        self.device = next(iter(caches.values())).device
        self.transport = transport
        self.mover = choose_mover(device_identity(self.device), consumer_device,
                                  "mooncake" if transport is not None else "nccl", spec.peer_writes)
        host, port = address.rsplit(":", 1)
        self.conn = FramedSocket(socket.create_connection((host, int(port)), timeout=spec.timeout_s))
        self.broken = ""
        self._lock = threading.Lock()
        sources = sorted({s for g in plan.groups for s, _ in g.units})
        self.conn.send(P2PHello(producer_rank=producer_rank, units=sources, mover=self.mover, pid=os.getpid()))
        ready = self.conn.recv()
        if not isinstance(ready, P2PReady) or ready.refused:
            self.conn.close()
            why = ready.refused if isinstance(ready, P2PReady) else f"answered {type(ready).__name__}"
            raise TransferError(f"consumer at {address} refused the pair: {why}")
        self.buffer_bytes = ready.buffer_bytes
        self.dst_table = None
        if self.mover == "peer":  # the consumer's caches, mapped here; written by one kernel per request
            enable_peer_access(self.device, local_device(consumer_device))
            self._mapped: dict[tuple, torch.Tensor] = {}
            # Opened in this GPU's context (CUDA IPC then maps the memory for this device's
            # kernels, over NVLink when it lives on another GPU).
            self.dst_caches = {n: map_cache(m, self.device, self._mapped) for n, m in ready.caches.items()}
            self.dst_table = RunTable(plan, self.dst_caches, "dst", device=self.device)
            self.buf, self.group = None, None
        elif self.mover == "ipc":
            self.buf, self.group = map_ipc(ready.ipc, self.device), None
        elif self.mover == "mooncake":  # pack (on the GPU), to host, one write into the consumer's buffer
            self.host = host_buffer(self.buffer_bytes, self.device)
            self.host_base = transport.register(self.host)
            self.remote = (ready.session, ready.base)
            self.group = None
            self.buf = self.host if self.device.type != "cuda" else torch.empty(
                self.buffer_bytes, dtype=torch.uint8, device=self.device)
        else:
            self.buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
            self.group = pair_group(self.mover, ready.store_path, 1, spec.timeout_s)
        self._sending: list = [None, None]  # the last send out of each half of ``buf``
        # On a GPU one kernel packs a chunk from a table of runs; on CPU, torch index ops.
        self.table = RunTable(plan, caches, "src") if self.device.type == "cuda" else None
        self._rows = None

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str = "") -> None:
        """Move one request's runs into the consumer's ``dst_blocks``; returns once they are
        in its caches. A failure leaves the pair broken (the next send fails at once)."""
        with self._lock:
            if self.broken:
                raise TransferError(f"the pair is broken: {self.broken}")
            try:
                self._send(src_blocks, dst_blocks, request_id)
            except TransferError:
                raise
            except Exception as err:  # a dead peer, a timeout, a collective error
                self.broken = f"{type(err).__name__}: {err}"
                raise TransferError(self.broken) from err

    def _send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str) -> None:
        limit = self.source_blocks
        if any(not 0 <= b < limit for b in src_blocks) or len(src_blocks) != len(dst_blocks):
            raise TransferError(f"source blocks {list(src_blocks)} (pool of {limit}) do not pair with "
                                f"{len(dst_blocks)} consumer blocks")
        phases = Phases(f"send {self.mover}", self.device)
        if self.mover == "peer":
            self._write_direct(src_blocks, dst_blocks, request_id, phases)
            return
        self._rows = self.table.rows(src_blocks) if self.table is not None else None
        self.conn.send(P2PRequest(request_id=request_id, dst_blocks=list(dst_blocks)))
        phases.mark("rows")
        if self.group is None:  # ipc, mooncake: into the consumer's own buffer, a chunk at a time
            parts = chunks(self.plan, len(src_blocks), self.buffer_bytes)
            for i, chunk in enumerate(parts):
                self._pack(chunk, self.buf, src_blocks)
                synchronize(self.device)
                phases.mark("pack")
                if self.mover == "mooncake":
                    self._write(size_of(chunk))
                    phases.mark("write")
                self.conn.send(P2PChunk(index=i, nbytes=size_of(chunk)))
                if i + 1 < len(parts):
                    self._ack(i)
                    phases.mark("ack")
        else:  # two halves: pack chunk i+1 while chunk i is on the wire
            half = self.buffer_bytes // 2
            parts = chunks(self.plan, len(src_blocks), half)
            for i, chunk in enumerate(parts):
                slot = self.buf[(i % 2) * half:(i % 2 + 1) * half]
                if self._sending[i % 2] is not None:
                    self._sending[i % 2].wait()  # that half's last send left (NCCL: the stream waits)
                phases.mark("wait")
                self._pack(chunk, slot, src_blocks)
                phases.mark("pack")
                self._sending[i % 2] = self.group.send([slot[:size_of(chunk)]], 0, 0)
                phases.mark("send")
        self._ack(max(len(parts) - 1, 0))
        phases.mark("ack")
        phases.report()

    def _write_direct(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str,
                      phases: Phases) -> None:
        """``peer``: every run from this rank's caches into the consumer's, one launch."""
        error = bad_blocks(dst_blocks, self.plan, self.dst_caches)
        if error:  # checked here: a wild address would fault this GPU's context, or theirs
            raise TransferError(error)
        self.conn.send(P2PRequest(request_id=request_id, dst_blocks=list(dst_blocks)))
        rows = direct_rows(self.table, src_blocks, self.dst_table, dst_blocks)
        phases.mark("rows")
        from pdflow.kernels.copy_runs import copy_runs  # GPU path only: loads Triton

        copy_runs(rows, self.table.max_words)
        synchronize(self.device)  # in their caches once this returns: one-sided, no ack to wait for
        phases.mark("write")
        self.conn.send(P2PChunk(index=0, nbytes=packed_nbytes(self.plan, len(src_blocks))))
        phases.report()

    def _write(self, nbytes: int) -> None:
        if self.buf is not self.host:
            self.host[:nbytes].copy_(self.buf[:nbytes])  # device to host, synchronous
        session, base = self.remote
        self.transport.write(session, Descriptors(src=[self.host_base], dst=[base], length=[nbytes]))

    def _pack(self, chunk: list[Piece], out: torch.Tensor, src_blocks: Sequence[int]) -> None:
        base = chunk[0].offset
        if self.table is not None:
            first, stop = self.table.span(chunk, len(src_blocks))
            from pdflow.kernels.copy_runs import copy_runs  # GPU path only: loads Triton

            copy_runs(self._rows[first:stop], self.table.max_words, shift=out.data_ptr() - base)
            return
        for p in chunk:
            pack_piece(self.plan, p, self.caches[p.src_unit], src_blocks, out[p.offset - base:p.offset - base + p.nbytes],
                       dst_block_bytes=self.dst_block_bytes[p.dst_unit])

    def _ack(self, index: int) -> None:
        ack = self.conn.recv()
        if not isinstance(ack, P2PAck) or ack.index != index:
            raise ConnectionError(f"expected the ack of chunk {index}, got {ack}")
        if ack.error:
            raise TransferError(f"consumer failed the request: {ack.error}")

    def close(self) -> None:
        self.conn.close()
        self.buf = None
        self.dst_caches, self._mapped, self.dst_table = {}, {}, None


class P2PListener:
    """A consumer rank's end: accepts producer ranks and scatters what they send."""

    def __init__(self, *, graph: RunGraph, rank: int, caches: Mapping[str, torch.Tensor], spec: TransferSpec,
                 buffer_bytes: int | None = None, transport: MooncakeTransport | None = None):
        self.graph, self.rank, self.caches, self.spec = graph, rank, dict(caches), spec
        self.transport = transport  # producers write into this rank's host staging through it
        self.buffer_bytes = buffer_bytes or spec.staging_mib << 20  # per producer rank paired
        self.device = next(iter(caches.values())).device
        self.identity = device_identity(self.device)
        host = spec.host or "127.0.0.1"
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._dir = tempfile.mkdtemp(prefix="pdflow-p2p-")
        self._sessions: list[_Session] = []
        self._closed = threading.Event()
        self.landed = 0  # requests scattered completely
        threading.Thread(target=self._accept, name=f"p2p-accept-{rank}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            session = _Session(self, FramedSocket(sock))
            self._sessions.append(session)
            threading.Thread(target=session.serve, name=f"p2p-recv-{self.rank}", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        for session in self._sessions:
            session.conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class _Session:
    """One producer rank's connection to a consumer rank, served on its own thread."""

    def __init__(self, listener: P2PListener, conn: FramedSocket):
        self.listener, self.conn = listener, conn
        self.table: RunTable | None = None
        self.host: torch.Tensor | None = None  # mooncake: the registered host staging

    def serve(self) -> None:
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            setup = self._pair()
            if setup is not None:
                device = self.listener.device
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                with side_stream(device):
                    while True:
                        self._serve_request(*setup)
        self.conn.close()

    def _pair(self):
        lis = self.listener
        hello = self.conn.recv()
        if not isinstance(hello, P2PHello):
            return None
        cut = next((c for c in lis.graph.cuts
                    if c.producer_rank == hello.producer_rank and c.consumer_rank == lis.rank), None)
        refused = ""
        if cut is None:
            refused = f"no cut plan joins producer rank {hello.producer_rank} to consumer rank {lis.rank}"
        else:
            plan = bound_plan(cut, set(hello.units))
            missing = sorted({d for g in plan.groups for _, d in g.units} - set(lis.caches))
            expected = ("mooncake",) if lis.transport is not None else (
                ("gloo",) if lis.identity == "cpu" else ("nccl", "ipc", "peer"))
            if missing:
                refused = f"consumer rank {lis.rank} has no caches for {missing}"
            elif hello.mover not in expected:
                refused = f"mover {hello.mover!r} cannot reach caches on {lis.identity}"
            elif hello.mover == "peer" and hello.pid == os.getpid():
                refused = ("transfer.peer_writes maps the consumer's caches through CUDA IPC, which needs the "
                           "producer rank in another process; run the instances' ranks as processes or use "
                           "transfer=nccl")
        if refused:
            self.conn.send(P2PReady(refused=refused))
            return None
        buffer_bytes = lis.buffer_bytes
        if hello.mover == "mooncake":  # bytes land in host staging; scattered from there (or its copy)
            self.host = host_buffer(buffer_bytes, lis.device)
            base = lis.transport.register(self.host)
            self.conn.send(P2PReady(buffer_bytes=buffer_bytes, session=lis.transport.session_id, base=base))
            buf = self.host if lis.device.type != "cuda" else torch.empty(buffer_bytes, dtype=torch.uint8,
                                                                          device=lis.device)
            group = None
        elif hello.mover == "peer":  # the producer writes the caches themselves: no buffer
            dst = {d for g in plan.groups for _, d in g.units}
            self.conn.send(P2PReady(caches={n: share_cache(lis.caches[n]) for n in sorted(dst)}))
            buf, group = None, None
        elif hello.mover == "ipc":
            buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=lis.device)
            self.conn.send(P2PReady(buffer_bytes=buffer_bytes, ipc=share_ipc(buf)))
            group = None
        else:
            buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=lis.device)
            path = os.path.join(lis._dir, f"pair-{hello.producer_rank}-{uuid.uuid4().hex}")
            self.conn.send(P2PReady(buffer_bytes=buffer_bytes, store_path=path))
            if lis.device.type == "cuda":
                torch.cuda.set_device(lis.device)
            group = pair_group(hello.mover, path, 0, lis.spec.timeout_s)
        sources = {u.name: u.bytes_per_block for u in lis.graph.rank(PRODUCER, hello.producer_rank).units}
        on_gpu = lis.device.type == "cuda" and hello.mover != "peer"
        self.table = RunTable(plan, lis.caches, "dst") if on_gpu else None
        return plan, buf, group, sources

    def _serve_request(self, plan: CutPlan, buf: torch.Tensor, group, src_block_bytes: dict[str, int]) -> None:
        self.conn.sock.settimeout(None)  # idle between requests
        request = self.conn.recv()
        if not isinstance(request, P2PRequest):
            raise ConnectionError(f"expected a request, got {type(request).__name__}")
        self.conn.sock.settimeout(self.listener.spec.timeout_s)
        blocks = request.dst_blocks
        error = bad_blocks(blocks, plan, self.listener.caches)
        if buf is None:  # peer: the producer wrote them (one-sided, checked there) and says when
            note = self.conn.recv()
            if not isinstance(note, P2PChunk) or note.index != 0:
                raise ConnectionError(f"expected the request's only chunk, got {note}")
            if error:
                raise ConnectionError(f"a producer wrote blocks this rank refuses: {error}")
            self.listener.landed += 1
            return
        rows = self.table.rows(blocks) if self.table is not None and not error else None

        def scatter(chunk: list[Piece], data: torch.Tensor) -> str:
            if error:
                return error  # the bytes were drained, never written
            try:
                base = chunk[0].offset
                if rows is not None:  # one kernel over the chunk's runs
                    first, stop = self.table.span(chunk, len(blocks))
                    from pdflow.kernels.copy_runs import copy_runs  # GPU path only: loads Triton

                    copy_runs(rows[first:stop], self.table.max_words, shift=data.data_ptr() - base, reverse=True)
                    return ""
                for p in chunk:
                    unpack_piece(plan, p, data[p.offset - base:p.offset - base + p.nbytes], blocks,
                                 self.listener.caches[p.dst_unit], src_block_bytes=src_block_bytes[p.src_unit])
                return ""
            except Exception as err:  # the request fails, the pair serves on
                return f"{type(err).__name__}: {err}"

        if group is None:  # ipc, mooncake: the chunk is in ``buf`` (or host staging); ack each chunk
            parts = chunks(plan, len(blocks), buf.numel())
            for i, chunk in enumerate(parts):
                note = self.conn.recv()
                if not isinstance(note, P2PChunk) or note.index != i or note.nbytes != size_of(chunk):
                    raise ConnectionError(f"expected chunk {i} of {size_of(chunk)} bytes, got {note}")
                if self.host is not None and self.host is not buf:
                    buf[:note.nbytes].copy_(self.host[:note.nbytes], non_blocking=True)  # host to device
                error = scatter(chunk, buf)
                synchronize(self.listener.device)
                if i + 1 < len(parts):
                    self.conn.send(P2PAck(index=i, error=error))
        else:  # two halves: receive chunk i+1 while chunk i is scattered
            half = buf.numel() // 2
            parts = chunks(plan, len(blocks), half)
            slots = [buf[:half], buf[half:2 * half]]
            pending = {}

            def post(i: int) -> None:
                pending[i] = group.recv([slots[i % 2][:size_of(parts[i])]], 1, 0)

            phases = Phases("recv", self.listener.device)
            if parts:
                post(0)
            for i, chunk in enumerate(parts):
                if i + 1 < len(parts):
                    post(i + 1)  # after chunk i-1's scatter in stream order: its half is free
                pending.pop(i).wait()
                phases.mark("recv")
                error = scatter(chunk, slots[i % 2])
                phases.mark("scatter")
            synchronize(self.listener.device)
            phases.report()
        self.conn.send(P2PAck(index=max(len(parts) - 1, 0), error=error))
        if not error:
            self.listener.landed += 1


