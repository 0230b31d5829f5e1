"""Starting an instance's ranks and carrying owner <-> rank messages.

``Launcher`` is the interface (so the same spec can be placed by torchrun-style static
rendezvous, Ray placement groups or SLURM); ``LocalLauncher`` starts one process per
rank on this host running a target named ``"module:function"``, so nothing depends on
re-importing the user's main module: a CPU rank is forked from a warm zygote (a fresh
``python -m pdflow.parallel.zygote`` that imported torch once, see ``zygote.py``), a GPU
rank is its own interpreter (``python -m pdflow.parallel.rank_entry``, as torchrun does). A rank that dies, errors or stops answering fails
the whole instance with ``RankFailed`` naming it, and every other rank is torn down:
never a hang, never an orphan.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from pdflow.graph import parallel_of
from pdflow.graph.devices import DeviceFacts
from pdflow.parallel import zygote
from pdflow.parallel.messages import Message, RankError, RankReady, Shutdown, decode, encode
from pdflow.parallel.rendezvous import RankRendezvous, StoreAddress
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
    store: StoreAddress  # the owner's rendezvous store (``rendezvous.py``)
    # The GPUs' memory the owner read at start, so this rank's graph sizes the owner's pool.
    devices: DeviceFacts | None = None


class Channel:
    """A rank's end of its pipe to the owner, speaking typed messages. Sends are locked:
    a producer rank's KV sender reports from its own thread."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: Message) -> None:
        data = encode(message)
        with self._send_lock:
            self._conn.send_bytes(data)

    def recv(self) -> Message:
        return decode(self._conn.recv_bytes())


RankTarget = Callable[[RankContext, Channel], None]


@dataclass(kw_only=True, slots=True)
class RankStart:
    """The first message a rank process reads: what to run, with which context, and the
    owner's import path (so a target importable there is importable in the rank)."""

    target: str
    context: RankContext
    sys_path: list[str]


def check_target(target: str) -> str:
    """A rank target is ``"package.module:function"``, importable by a fresh interpreter."""
    if not isinstance(target, str):
        raise TypeError(
            f"a rank target is a 'package.module:function' string, got {type(target).__name__}"
        )
    module, sep, name = target.partition(":")
    if not (sep and module and name.isidentifier()):
        raise ValueError(f"rank target {target!r} is not 'package.module:function'")
    if module == "__main__":
        raise ValueError(
            f"rank target {target!r} lives in __main__, which a rank process does not import; "
            "move it into an importable module"
        )
    return target


class Launcher(ABC):
    @abstractmethod
    def start(self) -> list[RankReady]: ...

    @abstractmethod
    def send(self, rank: int, message: Message) -> None: ...

    @abstractmethod
    def recv(self, rank: int, timeout_s: float) -> Message: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @abstractmethod
    def check(self) -> None:
        """Raise RankFailed if a rank is gone (without waiting for a message)."""

    def has_message(self, rank: int) -> bool:
        """Whether ``rank`` has sent a message not yet received (a ``recv`` returns at once)."""
        raise NotImplementedError(f"{type(self).__name__} cannot poll its ranks")

    def report_handles(self) -> list:
        """What ``multiprocessing.connection.wait`` can watch for the ranks' messages (none:
        an owner that would be woken by them polls instead)."""
        return []

    @property
    @abstractmethod
    def pids(self) -> list[int]: ...

    def broadcast(self, message: Message) -> None:
        for rank in range(self.world_size):
            self.send(rank, message)


class LocalLauncher(Launcher):
    """``target`` names the rank body as ``"package.module:function"``, called with
    (RankContext, Channel) in each rank process."""

    def __init__(self, spec: RunSpec, role: str, target: str, labels: list[str],
                 devices: DeviceFacts | None = None):
        par = parallel_of(spec, role)
        self.devices = devices
        self.spec, self.role, self.target, self.labels = spec, role, check_target(target), labels
        self.world_size = len(labels)
        self.ready_timeout_s = par.ready_timeout_s
        self._rendezvous: RankRendezvous | None = None
        self._rendezvous_args = (par.master_addr, par.master_port, par.step_timeout_s)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._exit_fds: list[int] = []  # pidfds: readable once their rank has exited
        # A GPU rank starts from a fresh interpreter: nothing may touch CUDA before its fork.
        self.use_zygote = par.device == "cpu" and zygote.usable()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def rendezvous(self) -> StoreAddress | None:
        """Where this instance's ranks meet (bound from ``start`` until ``shutdown``)."""
        return None if self._rendezvous is None else self._rendezvous.address

    def _spawn(self, rank: int) -> None:
        """One rank process, holding its end of a socket pair (no port, no key to guess)."""
        ours, theirs = socket.socketpair()
        with theirs:
            proc = self._start_process(rank, theirs.fileno())
        self._procs.append(proc)
        self._conns.append(Connection(ours.detach()))
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._exit_fds.append(os.pidfd_open(proc.pid))
        context = RankContext(
            spec=self.spec, role=self.role, rank=rank, world_size=self.world_size,
            store=self._rendezvous.address, devices=self.devices,
        )
        start = RankStart(target=self.target, context=context, sys_path=list(sys.path))
        try:
            self._conns[rank].send(start)
        except OSError as err:
            self._fail(rank, f"exited before it started ({err})")

    def _start_process(self, rank: int, fd: int):
        """Fork it from the warm zygote (CPU instances, Linux), else a fresh interpreter."""
        if self.use_zygote:
            try:
                return zygote.fork_rank(zygote.ForkRank(
                    label=self.labels[rank], target_module=self.target.partition(":")[0],
                    environ=dict(os.environ), cwd=os.getcwd(), sys_path=list(sys.path)), fd)
            except (OSError, ConnectionError, RuntimeError) as err:
                print(f"pdflow: starting ranks as fresh interpreters (the rank zygote failed: {err})",
                      file=sys.stderr)
                self.use_zygote = False
        return subprocess.Popen(
            [sys.executable, "-m", "pdflow.parallel.rank_entry", "--fd", str(fd),
             "--parent", str(os.getpid()), "--label", self.labels[rank]],
            pass_fds=(fd,), stdin=subprocess.DEVNULL,
        )

    def start(self) -> list[RankReady]:
        # Bound here, before any rank exists: ranks connect to a port already listening.
        self._rendezvous = RankRendezvous(*self._rendezvous_args)
        try:
            for rank in range(self.world_size):
                self._spawn(rank)
        except BaseException:  # e.g. Ctrl-C between two spawns: no rank is left behind
            self.shutdown(graceful=False)
            raise
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

    def report_handles(self) -> list:
        return list(self._conns)

    def has_message(self, rank: int) -> bool:
        try:
            return self._conns[rank].poll()
        except (EOFError, OSError):
            return True  # recv finds out why

    def recv(self, rank: int, timeout_s: float) -> Message:
        """Wait for one message from ``rank`` while watching every rank for death."""
        deadline = time.monotonic() + timeout_s
        conn = self._conns[rank]
        # Without pidfds (not Linux) exits are polled each second.
        poll_s = 60.0 if len(self._exit_fds) == len(self._procs) else 1.0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(rank, f"no answer within {timeout_s:.0f}s")
            ready = wait([conn, *self._exit_fds], timeout=min(remaining, poll_s))
            if conn in ready:
                try:
                    msg = decode(conn.recv_bytes())
                except (EOFError, OSError):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._procs[rank].wait(timeout=5)  # its socket closed: it is exiting
                    self._fail_dead(rank)
                if isinstance(msg, RankError):
                    self._fail(msg.rank, "raised:\n" + msg.error)
                return msg
            for dead, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self._fail_dead(dead)

    def check(self) -> None:
        """Raise RankFailed now if any rank has exited (a liveness probe between steps)."""
        for rank, proc in enumerate(self._procs):
            if proc.poll() is not None:
                self._fail_dead(rank)

    def _fail_dead(self, rank: int):
        """Fail on ``rank``'s exit, with the traceback it sent first if it sent one."""
        conn = self._conns[rank]
        with contextlib.suppress(EOFError, OSError):
            if conn.poll():
                msg = decode(conn.recv_bytes())
                if isinstance(msg, RankError):
                    self._fail(rank, "raised:\n" + msg.error)
        self._fail(rank, f"process exited with code {self._procs[rank].poll()}")

    def _fail(self, rank: int, why: str):
        self.shutdown(graceful=False)
        raise RankFailed(self.labels[rank], why)

    def shutdown(self, graceful: bool = True) -> None:
        if graceful:
            for proc, conn in zip(self._procs, self._conns, strict=True):
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        conn.send_bytes(encode(Shutdown(reason="owner shutdown")))
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for conn in self._conns:
            conn.close()
        for fd in self._exit_fds:
            os.close(fd)
        self._procs, self._conns, self._exit_fds = [], [], []
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
