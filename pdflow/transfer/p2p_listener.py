"""The consumer rank's end of the ``transfer.p2p`` pairs (``p2p``'s module docstring has
the protocol): a listener per rank, a session thread per producer rank that pairs, and the
per-request receive and scatter of each mover."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Mapping

import msgspec
import torch

from pdflow.graph import CONSUMER, PRODUCER, CutPlan, RunGraph, parallel_of
from pdflow.graph.transfer_buffers import pair_buffer_bytes
from pdflow.spec.transfer import TransferSpec
from pdflow.transfer.errors import TransferError
from pdflow.transfer.grants import new_key, nonce_matches, pairing_token, token_matches
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.p2p_messages import (
    FramedSocket,
    P2PAck,
    P2PChunk,
    P2PHello,
    P2PReady,
    P2PRequest,
    PeerClosed,
)
from pdflow.transfer.p2p_parts import (
    IN_PROCESS,
    GroupDeadline,
    Phases,
    abort_group,
    as_bytes_by_block,
    bad_blocks,
    copy_chunk,
    device_identity,
    mooncake_staging,
    pair_group,
    pool_blocks,
    request_chunks,
    share_cache,
    share_in_process,
    share_ipc,
    side_stream,
    size_of,
    synchronize,
    two_halves,
)
from pdflow.transfer.packing import Piece
from pdflow.transfer.run_table import RunTable

__all__ = ["P2PListener"]


class P2PListener:
    """A consumer rank's end: accepts producer ranks and scatters what they send."""

    def __init__(self, *, graph: RunGraph, rank: int, caches: Mapping[str, torch.Tensor], spec: TransferSpec,
                 buffer_bytes: int | None = None, transport: MooncakeTransport | None = None,
                 key: bytes | None = None):
        self.graph, self.rank, self.caches, self.spec = graph, rank, dict(caches), spec
        # The consumer owner's pairing key (``grants``; ``KVLink.open`` sets it): a hello
        # must present its token, a request its nonce for the blocks it names.
        self.key = key or new_key()
        self.transport = transport  # producers write into this rank's host staging through it
        # Per producer rank paired: transfer.staging_mib, or less when the longest request
        # this side serves packs into less (sized per pair from its cut plan); an explicit
        # ``buffer_bytes`` is taken as given.
        self.buffer_bytes = buffer_bytes or spec.staging_mib << 20
        self.fit_to_requests = buffer_bytes is None
        self.device = next(iter(caches.values())).device
        self.identity = device_identity(self.device)
        host = spec.host or "127.0.0.1"
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._dir = tempfile.mkdtemp(prefix="pdflow-p2p-")
        self._sessions: list[_Session] = []
        # Joined by close: a thread of this listener still ending after it would drop the
        # listener's last reference (and its tensors) while the interpreter finalizes,
        # and freeing a tensor then aborts the process ("terminate called without an
        # active exception": the GIL is gone, pthread_exit unwinds through torch's C++).
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self.landed = 0  # requests scattered completely
        self._start_thread(self._accept, f"p2p-accept-{rank}")

    @property
    def pairing(self) -> str:
        return pairing_token(self.key)

    def pair_buffer_bytes(self, plan: CutPlan) -> int:
        """The receive buffer of a pair: the graph's rule (``transfer_buffers``), for the
        longest request this consumer serves (max_model_len, or its whole pool)."""
        if not self.fit_to_requests:
            return self.buffer_bytes
        par = parallel_of(self.graph.spec, CONSUMER)
        tokens = min(self.graph.spec.model.max_model_len, self.graph.budgets[CONSUMER].pool_blocks * par.block_size)
        return min(self.buffer_bytes, pair_buffer_bytes(self.graph.spec, plan, tokens))

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            if self._closed.is_set():  # closed while it waited: pair nothing more
                sock.close()
                return
            session = _Session(self, FramedSocket(sock))
            self._sessions.append(session)
            self._start_thread(session.serve, f"p2p-recv-{self.rank}")

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self, join_s: float = 5.0) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):  # wakes the accepting thread (closing alone may not)
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for session in list(self._sessions):  # sessions leave the list as they end
            session.conn.close()
        until = time.monotonic() + join_s  # a session stuck in a device wait is left behind
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(max(0.0, until - time.monotonic()))
        shutil.rmtree(self._dir, ignore_errors=True)


class _Session:
    """One producer rank's connection to a consumer rank, served on its own thread."""

    def __init__(self, listener: P2PListener, conn: FramedSocket):
        self.listener, self.conn = listener, conn
        self.producer_rank: int | None = None  # once its hello came
        self.table: RunTable | None = None
        self.host: torch.Tensor | None = None  # mooncake: the registered host staging
        self.host_base: int | None = None  # and where the listener's engine registered it
        self.in_process = ""  # ipc, peer: its key in the in-process table, when one process holds both ranks
        self.chunks = None  # the pair's request_chunks, once it is set up
        self.pool = 0  # the consumer blocks the pair may write
        self.deadline = GroupDeadline(None)  # the pair's group's, once it has one
        self.slots: list[torch.Tensor] = []  # a pipelined pair's: the two halves of its buffer
        self.verdicts: list[torch.Tensor] = []  # and what it says of each request: ok (0), failed (1)

    def serve(self) -> None:
        try:
            self._serve()
        finally:  # a producer rank that pairs again opens a new session: the listener keeps live ones
            with contextlib.suppress(ValueError):
                self.listener._sessions.remove(self)
            IN_PROCESS.pop(self.in_process, None)
            if self.host_base is not None:  # its staging, registered for this session only
                with contextlib.suppress(Exception):  # the engine may be closed already (shutdown)
                    self.listener.transport.unregister(self.host_base)
                self.host_base = None

    def _serve(self) -> None:
        try:
            setup = self._pair()
        except BaseException as err:  # said here: the producer only sees the connection close
            print(f"p2p: consumer rank {self.listener.rank} failed while pairing:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            self.conn.close()
            if isinstance(err, OSError | TransferError | msgspec.DecodeError):  # a lost producer, a pair that
                return  # never connected, or a peer that does not speak the protocol
            raise
        try:
            if setup is not None:
                self.deadline = GroupDeadline(setup[2], self.conn.sock)
                device = self.listener.device
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                with side_stream(device):
                    while True:
                        self._serve_request(*setup)
        except (ConnectionError, OSError, TimeoutError, msgspec.DecodeError) as err:  # the producer left, a
            # deadline passed, or a frame that is no message
            if not isinstance(err, PeerClosed | ConnectionResetError) and not self.listener._closed.is_set():
                print(f"p2p: consumer rank {self.listener.rank} closes a pair: {type(err).__name__}: {err}",
                      file=sys.stderr, flush=True)
        except RuntimeError:  # torch.distributed: a receive's error or timeout
            print(f"p2p: consumer rank {self.listener.rank} closes a pair:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
        finally:
            if setup is not None:  # nothing of the pair may still wait on the GPU
                self.deadline.close()
                abort_group(setup[2])
            self.conn.close()

    def _pair(self):
        """Answer a producer's hello: refused (and why), or ready with the way in. What can
        fail here (an allocation, a registration, a mapping) fails before the answer, so the
        producer hears the reason instead of a closed socket."""
        lis = self.listener
        hello = self.conn.recv()
        if not isinstance(hello, P2PHello):  # said here: the other end only sees the connection close
            print(f"p2p: consumer rank {lis.rank} closed a connection that opened with {type(hello).__name__}, "
                  "not a pairing hello", file=sys.stderr, flush=True)
            return None
        self.producer_rank = hello.producer_rank
        if not token_matches(lis.key, hello.pairing):  # not a producer this consumer paired with
            print(f"p2p: consumer rank {lis.rank} refused a hello (producer rank {hello.producer_rank}) without "
                  "its pairing token", file=sys.stderr, flush=True)
            self.conn.send(P2PReady(refused=f"unknown hello: consumer rank {lis.rank} pairs only with a producer "
                                            "that presents its endpoint's pairing token (pair through the "
                                            "consumer's owner or /pdflow/pair)"))
            return None
        try:
            ready, setup = self._set_up(hello)
        except Exception as err:  # the socket is still good: the producer hears why
            ready, setup = P2PReady(refused=f"consumer rank {lis.rank} could not set up the pair: "
                                            f"{type(err).__name__}: {err}"), None
        self.conn.send(ready)
        if setup is None:
            return None
        plan, buf, group, sources = setup
        if ready.store_path:  # the pair's process group: both ends meet in its rendezvous
            if lis.device.type == "cuda":
                torch.cuda.set_device(lis.device)
            group = pair_group(hello.mover, ready.store_path, 0, lis.spec.timeout_s, buf[:buf.numel() // 2])
        return plan, buf, group, sources

    def _set_up(self, hello: P2PHello):
        """(the answer, (plan, buffer, group, source block bytes) or None when refused)."""
        lis = self.listener
        cut = lis.graph.cut(hello.producer_rank, lis.rank)
        if cut is None:
            return P2PReady(refused=f"no cut plan joins producer rank {hello.producer_rank} to consumer rank "
                                    f"{lis.rank}"), None
        plan = cut.over(set(hello.units))
        missing = sorted({d for g in plan.groups for _, d in g.units} - set(lis.caches))
        expected = ("mooncake",) if lis.transport is not None else (
            ("gloo",) if lis.identity == "cpu" else ("nccl", "ipc", "peer"))
        if missing:
            return P2PReady(refused=f"consumer rank {lis.rank} has no caches for {missing}"), None
        if hello.mover not in expected:
            return P2PReady(refused=f"mover {hello.mover!r} cannot reach caches on {lis.identity}"), None
        buffer_bytes = lis.pair_buffer_bytes(plan)
        group = None
        if hello.mover == "mooncake":  # bytes land in host staging; scattered from there (or its copy)
            self.host, self.host_base, buf = mooncake_staging(buffer_bytes, lis.device, lis.transport)
            ready = P2PReady(buffer_bytes=buffer_bytes, session=lis.transport.session_id, base=self.host_base)
        elif hello.mover == "peer":  # the producer writes the caches themselves: no buffer
            dst = sorted({d for g in plan.groups for _, d in g.units})
            if hello.pid == os.getpid():  # one process: the caches themselves
                self.in_process = share_in_process({n: as_bytes_by_block(lis.caches[n]) for n in dst})
                buf, ready = None, P2PReady(in_process=self.in_process)
            else:
                buf, ready = None, P2PReady(caches={n: share_cache(lis.caches[n]) for n in dst})
        elif hello.mover == "ipc":
            buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=lis.device)
            if hello.pid == os.getpid():  # one process: the buffer itself
                self.in_process = share_in_process(buf)
                ready = P2PReady(buffer_bytes=buffer_bytes, in_process=self.in_process)
            else:
                ready = P2PReady(buffer_bytes=buffer_bytes, ipc=share_ipc(buf.untyped_storage()))
        else:
            buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=lis.device)
            self.slots = two_halves(buf)  # the pipeline's two slots, and its verdicts: ok (0), failed (1)
            self.verdicts = [torch.tensor([v], dtype=torch.int64, device=lis.device) for v in (0, 1)]
            path = os.path.join(lis._dir, f"pair-{hello.producer_rank}-{uuid.uuid4().hex}")
            ready = P2PReady(buffer_bytes=buffer_bytes, store_path=path)
        sources = {u.name: u.bytes_per_block for u in lis.graph.rank(PRODUCER, hello.producer_rank).units}
        on_gpu = lis.device.type == "cuda" and hello.mover != "peer"
        self.table = RunTable(plan, lis.caches, "dst") if on_gpu else None
        if self.table is not None:  # the first request must not wait on Triton
            self.table.compile_copies(reverse=True, programs=lis.spec.copy_programs)
        self.chunks = request_chunks(plan)
        self.pool = pool_blocks(plan, lis.caches)
        return ready, (plan, buf, group, sources)

    def _parts(self, num_blocks: int) -> list[list[Piece]]:
        """A pipelined request's chunks (each fits one of ``slots``)."""
        return self.chunks(num_blocks, self.slots[0].numel(), self.listener.spec.chunk_ramp)

    def _post_first(self, blocks: list[int], group) -> dict:
        """The receive of a pipelined request's first chunk (both halves are free: the last
        request synchronized), posted before anything else on the request's path: the
        producer's first chunk cannot leave before it is posted."""
        if group is None:
            return {}
        parts = self._parts(len(blocks))
        return {0: group.recv([self.slots[0][:size_of(parts[0])]], 1, 0)} if parts else {}

    def _serve_request(self, plan: CutPlan, buf: torch.Tensor, group, src_block_bytes: dict[str, int]) -> None:
        self.conn.sock.settimeout(None)  # idle between requests
        request = self.conn.recv()
        if not isinstance(request, P2PRequest):
            raise ConnectionError(f"expected a request, got {type(request).__name__}")
        phases = Phases("recv", self.listener.device)  # from the request's arrival
        blocks = request.dst_blocks
        pending = self._post_first(blocks, group)  # first: the producer's first chunk waits on it
        self.conn.sock.settimeout(self.listener.spec.timeout_s)
        error = self._ungranted(request) or bad_blocks(blocks, self.pool)
        if buf is None:  # peer: the producer wrote them (one-sided, checked there) and says when
            note = self.conn.recv()
            if not isinstance(note, P2PChunk) or note.index != 0:
                raise ConnectionError(f"expected the request's only chunk, got {note}")
            if error:
                raise ConnectionError(f"a producer wrote blocks this rank refuses: {error}")
            self.listener.landed += 1
            return
        if group is not None:
            self._stream(request, plan, group, pending, error, src_block_bytes, phases)
            return
        # ipc, mooncake: the chunk is in ``buf`` (or host staging); ack each chunk
        parts = self.chunks(len(blocks), buf.numel())
        ids = self._block_ids(blocks, error)
        for i, chunk in enumerate(parts):
            note = self.conn.recv()
            if not isinstance(note, P2PChunk) or note.index != i or note.nbytes != size_of(chunk):
                raise ConnectionError(f"expected chunk {i} of {size_of(chunk)} bytes, got {note}")
            if self.host is not None and self.host is not buf:
                buf[:note.nbytes].copy_(self.host[:note.nbytes], non_blocking=True)  # host to device
            error = error or self._scatter(plan, chunk, buf, blocks, ids, src_block_bytes)
            synchronize(self.listener.device)
            if i + 1 < len(parts):
                self.conn.send(P2PAck(index=i, error=error))
                if error:  # the producer stops at this ack: the request ends here, the pair serves on
                    return
        if not error:
            self.listener.landed += 1  # counted before the ack: the producer may look once it returns
        self.conn.send(P2PAck(index=max(len(parts) - 1, 0), error=error))
        phases.mark("acked")
        phases.report()

    def _stream(self, request: P2PRequest, plan: CutPlan, group, pending: dict, error: str,
                src_block_bytes: dict[str, int], phases: Phases) -> None:
        """Over the pair's group: receive chunk i+1 into one half of the buffer while chunk i
        is scattered from the other, then send the verdict (``P2PPeer._verdict``). The first
        chunk's receive is already ``pending``."""
        blocks = request.dst_blocks
        parts, slots = self._parts(len(blocks)), self.slots

        def post(i: int) -> None:
            pending[i] = group.recv([slots[i % 2][:size_of(parts[i])]], 1, 0)

        phases.mark("posted")
        timeout_s = self.listener.spec.timeout_s
        with self.deadline.armed(timeout_s) as aborted:  # a producer that stalls or dies mid-request
            if len(parts) > 1:
                post(1)  # chunk 1 leaves after chunk 0 is through: posted after the first
            ids = self._block_ids(blocks, error)
            phases.mark("ids")
            for i, chunk in enumerate(parts):
                if 2 <= i + 1 < len(parts):
                    post(i + 1)  # after chunk i-1's scatter in stream order: its half is free
                pending.pop(i).wait()
                phases.mark("recv")
                error = error or self._scatter(plan, chunk, slots[i % 2], blocks, ids, src_block_bytes)
                phases.mark("scatter")
            if not error:
                self.listener.landed += 1  # counted before the verdict: the producer may look once it has it
            # The verdict, after the last scatter in stream order.
            group.send([self.verdicts[bool(error)]], 1, 0).wait()
            phases.mark("verdict")
            synchronize(self.listener.device)  # off the producer's path: its half-buffers are free again
        if aborted():
            if not error:
                self.listener.landed -= 1  # counted above; the verdict may never have left
            why = ("the producer closed the pair's connection mid-request" if self.deadline.peer_left
                   else f"the producer's chunks did not all come within {timeout_s} s")
            raise ConnectionError(f"request {request.request_id!r}: {why}; the pair's group was aborted")
        phases.mark("synced")
        if error:
            self.conn.send(P2PAck(index=max(len(parts) - 1, 0), error=error))
        phases.report()

    def _ungranted(self, request: P2PRequest) -> str:
        """Why a request is refused before a byte is scattered: its nonce is not the
        consumer owner's grant of the blocks it names."""
        if nonce_matches(self.listener.key, request.dst_blocks, request.nonce):
            return ""
        return (f"request {request.request_id!r}: its nonce does not grant blocks {request.dst_blocks} of consumer "
                f"rank {self.listener.rank}; refused, nothing scattered")

    def _block_ids(self, blocks: list[int], error: str) -> torch.Tensor | None:
        """The block ids ``copy_plan`` reads (GPU caches; none for a request already failed)."""
        return self.table.ids(blocks) if self.table is not None and not error else None

    def _scatter(self, plan: CutPlan, chunk: list[Piece], data: torch.Tensor, blocks: list[int],
                 ids: torch.Tensor | None, src_block_bytes: dict[str, int]) -> str:
        """Chunk ``chunk``'s bytes from ``data`` into this rank's caches; why it failed, or
        "" (the request fails, the pair serves on)."""
        try:
            copy_chunk(chunk, data, blocks, plan=plan, caches=self.listener.caches, other_block_bytes=src_block_bytes,
                       reverse=True, table=self.table, ids=ids, programs=self.listener.spec.copy_programs)
            return ""
        except Exception as err:
            return f"{type(err).__name__}: {err}"
