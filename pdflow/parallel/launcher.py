"""Starting an instance's ranks and carrying owner <-> rank messages.

``Launcher`` is the interface (so the same spec can be placed by torchrun-style static
rendezvous, Ray placement groups or SLURM); ``LocalLauncher`` spawns one process per
rank on this host. A rank that dies, errors or stops answering fails the whole instance
with ``RankFailed`` naming it, and every other rank is torn down: never a hang, never an
orphan.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from pdflow.graph import parallel_of
from pdflow.parallel.messages import Message, RankError, RankReady, Shutdown, decode, encode
from pdflow.spec import RunSpec


class RankFailed(RuntimeError):
    """A rank died, raised, or timed out; the instance has been torn down."""

    def __init__(self, label: str, why: str):
        self.label = label
        super().__init__(f"rank {label} failed: {why}")


@dataclass(kw_only=True, slots=True)
class RankContext:
    """What a rank process is given: the fully resolved spec (no resolvers) and its place."""

    spec: RunSpec
    role: str
    rank: int
    world_size: int
    init_method: str


class Channel:
    """A rank's end of its pipe to the owner, speaking typed messages."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def send(self, message: Message) -> None:
        self._conn.send_bytes(encode(message))

    def recv(self) -> Message:
        return decode(self._conn.recv_bytes())


# The rank's body, or its "module:function" path (imported in the rank process, so the
# transport never imports the worker).
RankTarget = Callable[[RankContext, Channel], None] | str


def resolve_target(target: RankTarget) -> Callable[[RankContext, Channel], None]:
    if callable(target):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _watch_parent(parent_pid: int) -> None:
    """Exit if the owner disappears, even while blocked in a collective."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def _rank_main(target: RankTarget, ctx: RankContext, conn: Connection, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    channel = Channel(conn)
    try:
        resolve_target(target)(ctx, channel)
    except BaseException:
        try:
            channel.send(RankError(rank=ctx.rank, error=traceback.format_exc()))
        finally:
            os._exit(1)


class Launcher(ABC):
    @abstractmethod
    def start(self) -> list[RankReady]: ...

    @abstractmethod
    def send(self, rank: int, message: Message) -> None: ...

    @abstractmethod
    def recv(self, rank: int, timeout_s: float) -> Message: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def pids(self) -> list[int]: ...

    def broadcast(self, message: Message) -> None:
        for rank in range(self.world_size):
            self.send(rank, message)


class LocalLauncher(Launcher):
    def __init__(self, spec: RunSpec, role: str, target: RankTarget, labels: list[str]):
        par = parallel_of(spec, role)
        self.spec, self.role, self.target, self.labels = spec, role, target, labels
        self.world_size = len(labels)
        self.ready_timeout_s = par.ready_timeout_s
        host = par.master_addr
        self.init_method = f"tcp://{host}:{par.master_port or free_port(host)}"
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> list[RankReady]:
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            rank_ctx = RankContext(
                spec=self.spec,
                role=self.role,
                rank=rank,
                world_size=self.world_size,
                init_method=self.init_method,
            )
            proc = ctx.Process(
                target=_rank_main,
                args=(self.target, rank_ctx, child, os.getpid()),
                name=f"pdflow-{self.labels[rank]}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        readies = []
        for rank in range(self.world_size):
            msg = self.recv(rank, self.ready_timeout_s)
            if not isinstance(msg, RankReady):
                self._fail(rank, f"sent {type(msg).__name__} before ready")
            readies.append(msg)
        return readies

    def send(self, rank: int, message: Message) -> None:
        try:
            self._conns[rank].send_bytes(encode(message))
        except (BrokenPipeError, OSError) as err:
            self._fail(rank, f"pipe closed ({err})")

    def recv(self, rank: int, timeout_s: float) -> Message:
        """Wait for one message from ``rank`` while watching every rank for death."""
        deadline = time.monotonic() + timeout_s
        conn = self._conns[rank]
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(rank, f"no answer within {timeout_s:.0f}s")
            ready = wait([conn, *sentinels], timeout=remaining)
            if conn in ready:
                try:
                    msg = decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(rank, "pipe closed")
                if isinstance(msg, RankError):
                    self._fail(msg.rank, "raised:\n" + msg.error)
                return msg
            for sentinel in ready:
                dead = sentinels[sentinel]
                code = self._procs[dead].exitcode
                # A rank that reported an error before exiting says why on its pipe.
                if self._conns[dead].poll():
                    try:
                        msg = decode(self._conns[dead].recv_bytes())
                        if isinstance(msg, RankError):
                            self._fail(dead, "raised:\n" + msg.error)
                    except (EOFError, OSError):
                        pass
                self._fail(dead, f"process exited with code {code}")

    def _fail(self, rank: int, why: str):
        self.shutdown(graceful=False)
        raise RankFailed(self.labels[rank], why)

    def shutdown(self, graceful: bool = True) -> None:
        if graceful:
            for proc, conn in zip(self._procs, self._conns, strict=True):
                if proc.is_alive():
                    with contextlib.suppress(OSError):
                        conn.send_bytes(encode(Shutdown(reason="owner shutdown")))
            for proc in self._procs:
                proc.join(timeout=5)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
