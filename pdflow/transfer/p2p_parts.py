"""What both ends of a ``transfer.p2p`` pair, and its movers, share: choosing how bytes
move, a process group's deadline and abort, CUDA IPC handles and the in-process handover,
the chunks of a request's packed stream, and tracing."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from pdflow.graph import CutPlan
from pdflow.transfer.errors import TransferError
from pdflow.transfer.p2p_messages import CudaIpcHandle
from pdflow.transfer.packing import Piece, copy_piece, packed_nbytes, pieces

# Per-phase times of each request, on stderr: "1" synchronizes the device at every phase
# (each phase's own cost, the pipeline serialised); "timeline" only stamps the host clock
# (CLOCK_MONOTONIC: both ends' stamps line up), so the pipeline runs as it serves.
TRACE = os.environ.get("PDFLOW_P2P_TRACE", "")


class Phases:
    """Where a request's time goes (tracing only)."""

    def __init__(self, who: str, device: torch.device):
        self.who, self.device, self.times = who, device, {}
        self.t = time.perf_counter()
        self.stamps = [("start", self.t)]

    def mark(self, phase: str) -> None:
        if not TRACE:
            return
        if TRACE == "timeline":
            self.stamps.append((phase, time.perf_counter()))
            return
        synchronize(self.device)
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + (now - self.t) * 1e3
        self.t = now

    def report(self) -> None:
        if TRACE == "timeline":
            t0 = self.stamps[0][1]
            print(f"p2p {self.who} @{t0 * 1e3:.3f}ms: " + " ".join(f"{k}+{(t - t0) * 1e3:.3f}" for k, t in self.stamps[1:]),
                  file=sys.stderr, flush=True)
        elif TRACE:
            print(f"p2p {self.who}: " + " ".join(f"{k}={v:.2f}ms" for k, v in self.times.items()),
                  file=sys.stderr, flush=True)


def device_identity(device: torch.device) -> str:
    """``cpu``, or the GPU's UUID (the same physical GPU under any device numbering)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def choose_mover(producer: str, consumer: str, backend: str = "nccl", peer_writes: bool = False) -> str:
    if backend == "mooncake":
        return "mooncake"  # through host staging, whatever the caches: Mooncake here moves host memory
    if producer == "cpu" and consumer == "cpu":
        return "gloo"
    if "cpu" in (producer, consumer):
        raise TransferError(f"transfer=nccl moves between caches of one kind; producer on {producer}, "
                            f"consumer on {consumer}")
    if peer_writes and producer != consumer:  # the producer's GPU must write the consumer's (both seen here, peers)
        mine, theirs = local_device(producer), local_device(consumer)
        peer_writes = mine is not None and theirs is not None and torch.cuda.can_device_access_peer(mine, theirs)
    if peer_writes:
        return "peer"
    return "ipc" if producer == consumer else "nccl"


def local_device(identity: str) -> torch.device | None:
    """This process's CUDA device with that identity (``device_identity``), if it sees one."""
    if identity.startswith("cuda:") and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if device_identity(torch.device("cuda", i)) == identity:
                return torch.device("cuda", i)
    return None


def chunks(plan: CutPlan, num_blocks: int, max_bytes: int, ramp: int = 0) -> list[list[Piece]]:
    """The packed stream of a request, as runs of whole pieces of at most ``max_bytes``.
    ``ramp`` > 0 (a pipeline): the first and last chunks are smaller (``max_bytes >> ramp``
    doubling up, then halving down), so the wire starts after a short pack and the last
    scatter is short."""
    total = packed_nbytes(plan, num_blocks)
    per_block = max((g.bytes_per_unit for g in plan.groups), default=1)
    limits = _ramp(total, max_bytes, ramp, floor=per_block)
    out: list[list[Piece]] = []
    size = 0
    for piece in pieces(plan, num_blocks, max(min(limits), per_block)):
        limit = limits[len(out) - 1] if len(out) <= len(limits) else max_bytes
        if out and size + piece.nbytes <= limit:
            out[-1].append(piece)
            size += piece.nbytes
        else:
            out.append([piece])
            size = piece.nbytes
    return out


def request_chunks(plan: CutPlan, remembered: int = 64) -> Callable[..., list[list[Piece]]]:
    """A pair's ``chunks(num_blocks, max_bytes, ramp=0)`` for the last ``remembered``
    request shapes (both ends derive the same lists from the same plan)."""
    return functools.lru_cache(maxsize=remembered)(functools.partial(chunks, plan))


def _ramp(total: int, max_bytes: int, ramp: int, *, floor: int) -> list[int]:
    """Chunk size limits for ``total`` bytes: a ramp up, even chunks of at most
    ``max_bytes``, the same ramp down (each step only while the bytes left exceed it twice)."""
    head = []
    left = total
    for shift in range(ramp, 0, -1):
        size = max(max_bytes >> shift, floor)
        if size >= max_bytes or left <= 2 * size:
            break
        head.append(size)
        left -= 2 * size
    n = max(1, -(-left // max_bytes))
    return head + [max(-(-left // n), floor)] * n + head[::-1]


def abort_group(group: dist.ProcessGroup | None) -> None:
    """Cancel what a broken pair's NCCL group still has in flight: a send whose receiver
    died waits on the GPU for good, until torch's watchdog ends this whole process (and
    every other pair of the rank). Gloo's waits end with its own timeout."""
    if _is_nccl(group):
        with contextlib.suppress(Exception):  # already aborted, or torch without abort()
            group.abort()


def _is_nccl(group: dist.ProcessGroup | None) -> bool:
    return isinstance(group, getattr(dist, "ProcessGroupNCCL", ()))  # CPU builds of torch have no NCCL


class GroupDeadline:
    """Aborts a pair's NCCL group when a request's deadline passes while it is armed, or
    sooner when the other end closes the pair's control connection. A send or receive whose
    peer died or stalled waits on the GPU for good, and so would the host (in a synchronize,
    or in NCCL's enqueue once its queue is full); aborting ends both. One watching thread
    per pair, armed per request by an attribute: nothing starts on the request's path."""

    POLL_S = 0.05

    def __init__(self, group: dist.ProcessGroup | None, conn: socket.socket | None = None):
        self.group, self.conn, self.fired, self.peer_left = group, conn, False, False
        self._until: float | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if _is_nccl(group):
            threading.Thread(target=self._watch, name="p2p-deadline", daemon=True).start()

    @contextlib.contextmanager
    def armed(self, seconds: float):
        """Abort the group if the block is still running after ``seconds``; yields a
        callable saying whether it did."""
        with self._lock:
            self.fired, self.peer_left, self._until = False, False, time.monotonic() + seconds
        try:
            yield lambda: self.fired
        finally:
            with self._lock:
                self._until = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self.POLL_S):
            with self._lock:
                armed = self._until is not None
                due = armed and time.monotonic() >= self._until
                left = armed and not due and self.conn is not None and peer_closed(self.conn)
                if due or left:
                    self.fired, self.peer_left, self._until = True, left, None
            if due or left:
                abort_group(self.group)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` has closed it: an end of stream waiting, nothing
    before it (a message waiting, such as an error's text, is not a close). Reads nothing."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset by the peer, or closed here
        return True


# What a consumer rank hands a producer rank of its own process (its receive buffer, or
# its caches) in place of CUDA IPC handles, which cannot be opened in the process that
# made them. By key; the consumer's session removes its entry.
IN_PROCESS: dict[str, object] = {}


def share_in_process(value: object) -> str:
    key = uuid.uuid4().hex
    IN_PROCESS[key] = value
    return key


def share_ipc(storage: torch.UntypedStorage) -> CudaIpcHandle:
    (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = storage._share_cuda_()
    return CudaIpcHandle(device=device, handle=handle, size=size, offset=offset, ref_counter_handle=ref_handle,
                         ref_counter_offset=ref_offset, event_handle=event, event_sync_required=event_sync)


def map_ipc(h: CudaIpcHandle, device: torch.device) -> torch.Tensor:
    """``h``'s buffer in this process (on ``device``: the GPU it lives on, as seen here)."""
    storage = torch.UntypedStorage._new_shared_cuda(device.index, h.handle, h.size, h.offset, h.ref_counter_handle,
                                                    h.ref_counter_offset, h.event_handle, h.event_sync_required)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def side_stream(device: torch.device):
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def size_of(chunk: list[Piece]) -> int:
    return sum(p.nbytes for p in chunk)


def pool_blocks(plan: CutPlan, caches: Mapping[str, torch.Tensor]) -> int:
    """The consumer blocks every destination unit of ``plan`` holds (a pair's, once)."""
    return min((caches[d].shape[0] for g in plan.groups for _, d in g.units), default=0)


def bad_blocks(blocks: Sequence[int], limit: int) -> str:
    """Why these consumer block ids (a pool of ``limit``) cannot be written: checked before
    any byte lands (on a GPU an out-of-range index takes the device context down)."""
    if len(set(blocks)) != len(blocks):
        return f"consumer block ids repeat: {list(blocks)}"
    out = [b for b in blocks if not 0 <= b < limit]
    return f"consumer block ids {out} are outside the pool of {limit} blocks" if out else ""


def copy_chunk(chunk: list[Piece], data: torch.Tensor, blocks: Sequence[int], *, plan: CutPlan,
               caches: Mapping[str, torch.Tensor], other_block_bytes: Mapping[str, int], reverse: bool,
               table=None, ids: torch.Tensor | None = None, programs: int = 0) -> None:
    """Chunk ``chunk`` of a request between the packed bytes ``data`` and this rank's
    ``caches``: packed from them, or (``reverse``) scattered into them. One ``copy_plan``
    launch on a GPU (``ids``: from the pair's ``RunTable``), torch index ops on CPU."""
    base = chunk[0].offset
    if ids is not None:
        first, stop = table.span(chunk, len(blocks))
        from pdflow.kernels.copy_runs import copy_plan  # GPU path only: loads Triton

        copy_plan(table.plan, ids, len(blocks), first, stop, table.max_words, shift=data.data_ptr() - base,
                  reverse=reverse, programs=programs)
        return
    for p in chunk:
        mine, other = (p.dst_unit, p.src_unit) if reverse else (p.src_unit, p.dst_unit)
        copy_piece(plan, p, caches[mine], blocks, data[p.offset - base:p.offset - base + p.nbytes],
                   other_block_bytes=other_block_bytes[other], reverse=reverse)
