"""The consumer rank's end of the ``p2p`` pairs: a listener per rank, and a session thread
per producer rank that pairs, which checks its token, each request's nonce and blocks."""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping

import msgspec
import torch

from pdflow.graph import CONSUMER, PRODUCER, CutPlan, RunGraph, parallel_of
from pdflow.graph.transfer_buffers import pair_buffer_bytes
from pdflow.spec.transfer import TransferSpec
from pdflow.transfer.errors import TransferError
from pdflow.transfer.grants import new_key, nonce_matches, pairing_token, token_matches
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.movers import MOVERS, Receiver
from pdflow.transfer.p2p_messages import FramedSocket, P2PHello, P2PReady, P2PRequest, PeerClosed
from pdflow.transfer.p2p_parts import (
    GroupDeadline,
    Phases,
    abort_group,
    bad_blocks,
    copy_chunk,
    device_identity,
    pool_blocks,
    request_chunks,
    side_stream,
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
        self.key = key or new_key()  # the consumer owner's (``grants``): hellos and nonces are checked with it
        self.transport = transport  # producers write into this rank's host staging through it
        # Per pair: transfer.staging_mib, or less when the longest request packs into less
        # (``pair_buffer_bytes``); an explicit ``buffer_bytes`` is taken as given.
        self.buffer_bytes = buffer_bytes or spec.staging_mib << 20
        self.fit_to_requests = buffer_bytes is None
        self.device = next(iter(caches.values())).device
        self.identity = device_identity(self.device)
        host = spec.host or "127.0.0.1"
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._dir = tempfile.mkdtemp(prefix="pdflow-p2p-")
        self._sessions: list[_Session] = []
        # Joined by close: a thread still ending while the interpreter finalizes would free
        # the listener's tensors without the GIL, which aborts the process.
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self.landed = 0  # requests scattered completely
        self._start_thread(self._accept, f"p2p-accept-{rank}")

    @property
    def pairing(self) -> str:
        return pairing_token(self.key)

    def pair_buffer_bytes(self, plan: CutPlan) -> int:
        """A pair's receive buffer: the graph's rule for the longest request served here."""
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
    """One producer rank's connection, on its own thread: the pairing checks are here, how
    its bytes move is its mover's (``receiver``)."""

    def __init__(self, listener: P2PListener, conn: FramedSocket):
        self.listener, self.conn = listener, conn
        self.producer_rank: int | None = None  # once its hello came
        self.receiver: Receiver | None = None  # once the hello passed its checks
        self.plan: CutPlan | None = None  # what the pair moves, and the producer's bytes per block of each unit
        self.sources: dict[str, int] = {}
        self.table: RunTable | None = None
        self.chunks = None  # the pair's request_chunks, once it is set up
        self.pool = 0  # the consumer blocks the pair may write
        self.deadline = GroupDeadline(None)  # the pair's group's, once it has one

    def serve(self) -> None:
        try:
            self._serve()
        finally:  # a producer rank that pairs again opens a new session: the listener keeps live ones
            with contextlib.suppress(ValueError):
                self.listener._sessions.remove(self)
            if self.receiver is not None:
                self.receiver.release()

    def _serve(self) -> None:
        try:
            paired = self._pair()
        except BaseException as err:  # said here: the producer only sees the connection close
            _log(f"consumer rank {self.listener.rank} failed while pairing:\n{traceback.format_exc()}")
            self.conn.close()
            if isinstance(err, OSError | TransferError | msgspec.DecodeError):  # a lost producer, a pair that
                return  # never connected, or a peer that does not speak the protocol
            raise
        try:
            if paired:
                self.deadline = GroupDeadline(self.receiver.group, self.conn.sock)
                device = self.listener.device
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                with side_stream(device):
                    while True:
                        self._serve_request()
        except (ConnectionError, OSError, TimeoutError, msgspec.DecodeError) as err:  # the producer left, a
            # deadline passed, or a frame that is no message
            if not isinstance(err, PeerClosed | ConnectionResetError) and not self.listener._closed.is_set():
                _log(f"consumer rank {self.listener.rank} closes a pair: {type(err).__name__}: {err}")
        except RuntimeError:  # torch.distributed: a receive's error or timeout
            _log(f"consumer rank {self.listener.rank} closes a pair:\n{traceback.format_exc()}")
        finally:
            if paired:  # nothing of the pair may still wait on the GPU
                self.deadline.close()
                abort_group(self.receiver.group)
            self.conn.close()

    def _pair(self) -> bool:
        """Answer a producer's hello: refused (and why), or ready. What can fail (an
        allocation, a registration, a mapping) fails before the answer, so the producer
        hears the reason instead of a closed socket. Whether it paired."""
        lis = self.listener
        hello = self.conn.recv()
        if not isinstance(hello, P2PHello):  # said here: the other end only sees the connection close
            _log(f"consumer rank {lis.rank} closed a connection that opened with {type(hello).__name__}, not a hello")
            return False
        self.producer_rank = hello.producer_rank
        if not token_matches(lis.key, hello.pairing):  # not a producer this consumer paired with
            _log(f"consumer rank {lis.rank} refused a hello (producer rank {hello.producer_rank}) without its token")
            self.conn.send(P2PReady(refused=f"unknown hello: consumer rank {lis.rank} pairs only with a producer "
                                            "that presents its endpoint's pairing token (pair through the "
                                            "consumer's owner or /pdflow/pair)"))
            return False
        try:
            ready = self._set_up(hello)
        except Exception as err:  # the socket is still good: the producer hears why
            ready = P2PReady(refused=f"consumer rank {lis.rank} could not set up the pair: "
                                     f"{type(err).__name__}: {err}")
        self.conn.send(ready)
        if ready.refused:
            return False
        self.receiver.connect(hello, ready)  # a process group: both ends meet in its rendezvous
        return True

    def _set_up(self, hello: P2PHello) -> P2PReady:
        """The answer: refused (and why), or the receiver's way in."""
        lis = self.listener
        cut = lis.graph.cut(hello.producer_rank, lis.rank)
        if cut is None:
            return P2PReady(refused=f"no cut plan joins producer rank {hello.producer_rank} to consumer rank "
                                    f"{lis.rank}")
        plan = cut.over(set(hello.units))
        missing = sorted({d for g in plan.groups for _, d in g.units} - set(lis.caches))
        expected = ("mooncake",) if lis.transport is not None else (
            ("gloo",) if lis.identity == "cpu" else ("nccl", "ipc", "peer"))
        if missing:
            return P2PReady(refused=f"consumer rank {lis.rank} has no caches for {missing}")
        if hello.mover not in expected:
            return P2PReady(refused=f"mover {hello.mover!r} cannot reach caches on {lis.identity}")
        buffer_bytes = lis.pair_buffer_bytes(plan)
        self.plan = plan
        self.receiver = MOVERS[hello.mover][1](self)
        ready = self.receiver.set_up(hello, buffer_bytes)
        self.sources = {u.name: u.bytes_per_block for u in lis.graph.rank(PRODUCER, hello.producer_rank).units}
        on_gpu = lis.device.type == "cuda" and not self.receiver.direct
        self.table = RunTable(plan, lis.caches, "dst") if on_gpu else None
        if self.table is not None:  # the first request must not wait on Triton
            self.table.compile_copies(reverse=True, programs=lis.spec.copy_programs)
        self.chunks = request_chunks(plan)
        self.pool = pool_blocks(plan, lis.caches)
        return ready

    def _serve_request(self) -> None:
        self.conn.sock.settimeout(None)  # idle between requests
        request = self.conn.recv()
        if not isinstance(request, P2PRequest):
            raise ConnectionError(f"expected a request, got {type(request).__name__}")
        phases = Phases("recv", self.listener.device)  # from the request's arrival
        blocks = request.dst_blocks
        pending = self.receiver.post_first(blocks)  # first: the producer's first chunk waits on it
        self.conn.sock.settimeout(self.listener.spec.timeout_s)
        # Refused before a byte is scattered: a nonce that is not the owner's grant of these blocks.
        granted = nonce_matches(self.listener.key, blocks, request.nonce)
        error = bad_blocks(blocks, self.pool) if granted else (
            f"request {request.request_id!r}: its nonce does not grant blocks {blocks} of consumer "
            f"rank {self.listener.rank}; refused, nothing scattered")
        self.receiver.receive(request, error, pending, phases)

    def block_ids(self, blocks: list[int], error: str) -> torch.Tensor | None:
        """The block ids ``copy_plan`` reads (GPU caches; none for a request already failed)."""
        return self.table.ids(blocks) if self.table is not None and not error else None

    def scatter(self, chunk: list[Piece], data: torch.Tensor, blocks: list[int], ids: torch.Tensor | None) -> str:
        """Chunk ``chunk``'s bytes from ``data`` into this rank's caches; why it failed, or
        "" (the request fails, the pair serves on)."""
        try:
            copy_chunk(chunk, data, blocks, plan=self.plan, caches=self.listener.caches,
                       other_block_bytes=self.sources, reverse=True, table=self.table, ids=ids,
                       programs=self.listener.spec.copy_programs)
            return ""
        except Exception as err:
            return f"{type(err).__name__}: {err}"


def _log(text: str) -> None:
    print(f"p2p: {text}", file=sys.stderr, flush=True)
