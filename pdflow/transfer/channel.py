"""The side channel: one ZMQ inbox per rank, typed messages only.

Each rank binds a PULL socket (127.0.0.1 and a free port by default) and sends to
other ranks' inboxes through PUSH sockets it connects on first use. Every frame is
decoded strictly (``messages.decode``); anything else (random bytes, several frames,
an unknown tag, a frame over ``max_frame_bytes``) is counted in ``rejected`` and
dropped, and the endpoint keeps serving. ``recv`` belongs to one thread; ``send`` may
be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from pdflow.transfer.messages import Message, decode, encode

log = logging.getLogger(__name__)


class ChannelError(RuntimeError):
    """A message could not be handed to the peer's inbox in time."""


class Endpoint:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, max_frame_bytes: int = 16 << 20,
                 send_timeout_s: float = 5.0):
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # larger frames drop the connection
        if port:
            self._inbox.bind(f"tcp://{host}:{port}")
        else:
            port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.rejected = 0
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._outboxes: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)

    def send(self, address: str, message: Message) -> None:
        """Queue ``message`` for the inbox at ``address`` (``tcp://host:port``)."""
        frame = encode(message)
        with self._send_lock:
            out = self._outboxes.get(address)
            if out is None:
                out = self._outboxes[address] = self._ctx.socket(zmq.PUSH)
                out.setsockopt(zmq.LINGER, 0)
                out.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                out.connect(address)
            try:
                out.send(frame)
            except zmq.Again as err:
                raise ChannelError(f"{address} took no message within {self._send_timeout_ms} ms") from err

    def recv(self, timeout_s: float = 0.0) -> Message | None:
        """The next well-formed message, or None when none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for _ in range(1024):  # a flood of garbage cannot hold the caller forever
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._poller.poll(wait_ms):
                return None
            frames = self._inbox.recv_multipart(zmq.NOBLOCK)
            try:
                if len(frames) != 1:
                    raise msgspec.DecodeError(f"{len(frames)} frames, expected 1")
                return decode(frames[0])
            except msgspec.DecodeError as err:
                self.rejected += 1
                log.warning("side channel %s: rejected a malformed frame (%s)", self.address, err)
        return None

    def close(self) -> None:
        with self._send_lock:
            for out in self._outboxes.values():
                out.close(0)
            self._outboxes.clear()
        self._inbox.close(0)
        self._ctx.term()
