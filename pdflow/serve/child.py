"""Start a server's child process (the engine core, an API front): ``python -m pdflow.serve.child``.

Why not ``multiprocessing``: its spawn re-imports the parent's main module, which breaks
(or re-runs) any script without a ``__main__`` guard. A child here is a fresh interpreter
that imports only pdflow and its target, reads its arguments (pickled) from stdin, gets the
descriptors it needs by ``pass_fds``, and runs in a session of its own so a Ctrl-C reaches
only the server, which stops its children in order.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys


class Child:
    """A started child: ``pid``, ``sentinel`` (a pidfd, readable once it exited), ``exitcode``."""

    def __init__(self, target: str, args: tuple, *, pass_fds: tuple[int, ...] = ()):
        self.proc = subprocess.Popen([sys.executable, "-m", "pdflow.serve.child", target], stdin=subprocess.PIPE,
                                     pass_fds=pass_fds, start_new_session=True)
        self.proc.stdin.write(pickle.dumps(args))
        self.proc.stdin.close()
        self.pid = self.proc.pid
        self.sentinel = os.pidfd_open(self.pid)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            self.proc.terminate()

    def join(self, timeout: float | None = None) -> None:
        """Wait for it to exit; after ``timeout``, kill it."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        os.close(self.sentinel)


def main() -> None:
    module, _, name = sys.argv[1].partition(":")
    args = pickle.loads(sys.stdin.buffer.read())
    getattr(importlib.import_module(module), name)(*args)


if __name__ == "__main__":
    main()
