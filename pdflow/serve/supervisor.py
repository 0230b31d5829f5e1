"""The server process: binds the listening socket, starts the engine-core process and
``serve.api_servers`` API front processes sharing that socket, and watches them.

A front that dies is started again on the same socket (the core keeps every request's
state; the dead front's requests are aborted when its successor says hello). A front that
cannot start (it exits before it says it serves, through a pipe of its own,
``FRONT_CRASH_LIMIT`` times in a row: an import error, a bad option) fails the server
instead of being restarted forever while the listening socket queues connections nobody
answers. Not a time window: on a loaded host a front's imports alone can outlast one. A core that
dies fails the server: the fronts answer what was open with 503 (they see the core's exit
themselves), get a moment to send it, are stopped, and ``failure`` names what happened so
``pdflow serve`` exits non-zero. ``stop`` (SIGTERM to ``pdflow serve``): fronts first
(graceful), then the core (fails what is left with 503, stops its ranks), nothing left over.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait

from pdflow.serve.child import Child
from pdflow.serve.front_process import FrontOptions
from pdflow.spec import RunSpec

FAILED_CORE_GRACE_S = 3.0
STOP_TIMEOUT_S = 30.0
BACKLOG = 2048
FRONT_CRASH_LIMIT = 3


class Supervisor:
    # What each API front process runs (``module:function``).
    FRONT_TARGET = "pdflow.serve.front_process:front_main"

    def __init__(self, spec: RunSpec, *, host: str, port: int, options: FrontOptions):
        self.spec, self.options = spec, options
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(BACKLOG)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._dir = tempfile.TemporaryDirectory(prefix="pdflow-core-")
        self.address = f"ipc://{self._dir.name}/core"
        self.core = None
        self.fronts: list = [None] * spec.serve.api_servers
        # Per front: the read end of the pipe it writes a byte to once it serves.
        self._ready_pipes: list[int | None] = [None] * spec.serve.api_servers
        self._failed_starts = [0] * spec.serve.api_servers
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pdflow-supervisor", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> Supervisor:
        self.core = Child("pdflow.serve.core_process:core_main", (self.spec, self.address, os.getpid()))
        for i in range(len(self.fronts)):
            self._start_front(i)
        self._watcher.start()
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 (the core's engine is up); a named error if the core
        died first or after ``timeout``."""
        from pdflow.serve.server import wait_healthy

        wait_healthy(self.url, timeout=timeout, failed=lambda: self.failure)

    def stop(self) -> None:
        self._stopping.set()
        for front in self.fronts:
            if front is not None and front.is_alive():
                front.terminate()
        for front in self.fronts:
            if front is not None:
                self._join(front)
        if self.core is not None and self.core.is_alive():
            self.core.terminate()
        if self.core is not None:
            self._join(self.core)
        if self._watcher.is_alive():
            self._watcher.join(5.0)
        for fd in self._ready_pipes:
            if fd is not None:
                os.close(fd)
        for child in [*self.fronts, self.core]:
            if child is not None:
                child.close()
        self.sock.close()
        self._dir.cleanup()

    # -- watching ------------------------------------------------------------------------

    def _start_front(self, i: int) -> None:
        fd = self.sock.fileno()
        ready_r, ready_w = os.pipe()
        self._ready_pipes[i] = ready_r
        try:
            self.fronts[i] = Child(self.FRONT_TARGET, (fd, ready_w, self.address, i, self.core.pid, os.getpid(),
                                                       self.options), pass_fds=(fd, ready_w))
        finally:
            os.close(ready_w)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            sentinels = {self.core.sentinel: None} | {f.sentinel: i for i, f in enumerate(self.fronts)}
            for ready in wait(list(sentinels), timeout=0.5):
                if self._stopping.is_set():
                    return
                which = sentinels[ready]
                if which is None:
                    self._core_died()
                    return
                if self._front_exited(which):
                    return
                self._start_front(which)

    def _front_exited(self, i: int) -> bool:
        """Reap front ``i``; True (and ``failure`` set) when it keeps dying as it starts."""
        front = self.fronts[i]
        front.join()
        code = front.exitcode
        front.close()
        served = _said_ready(self._ready_pipes[i])
        self._ready_pipes[i] = None
        self._failed_starts[i] = 0 if served else self._failed_starts[i] + 1
        if self._failed_starts[i] < FRONT_CRASH_LIMIT:
            return False
        self.fronts[i] = None
        self.failure = (f"API front process {i} exited {FRONT_CRASH_LIMIT} times before it served "
                        f"(last exit code {code}); its error is above")
        return True

    def _core_died(self) -> None:
        self.core.join()
        time.sleep(FAILED_CORE_GRACE_S)  # the fronts answer their open requests with 503
        self.failure = f"the engine core process exited (code {self.core.exitcode})"

    def _join(self, child: Child) -> None:
        child.join(STOP_TIMEOUT_S)


def _said_ready(fd: int) -> bool:
    """Whether the front wrote its byte before it exited (its pipe is then at EOF)."""
    try:
        return os.read(fd, 1) == b"r"
    finally:
        os.close(fd)
