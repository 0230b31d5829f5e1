"""The API front's side of the engine core: what ``api.py`` and ``generation.py`` use of
the in-process ``EngineLoop`` (``open_stream``, ``abort``, ``healthy``, ``error``), over ZMQ.

All of it runs on the front's asyncio loop (zmq.asyncio; no thread shares this process's
interpreter lock with it). One reader task takes the core's ``Steps`` messages, turns each
``Delta`` into a ``StreamEvent`` (text decoded here, per request) and puts it on that
request's queue. The core's death is seen through a pidfd (readable once it exits), and
every open request then ends with a 503 error, as do later ones: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.core_wire import (
    Abort,
    Facts,
    Hello,
    Outcome,
    Query,
    Reply,
    Steps,
    Submit,
    encode,
    front_decoder,
    to_event,
)
from pdflow.serve.serving_core import StreamEvent
from pdflow.serve.text_stream import TextStream

if TYPE_CHECKING:
    from pdflow.serve.pd_wire import PDRoute


@dataclass(kw_only=True, slots=True)
class RemoteTicket:
    rid: str
    events: asyncio.Queue
    text: TextStream
    tag: int | None = None  # set: events go on ``events`` as (tag, event)

    def put(self, event: StreamEvent) -> None:
        self.events.put_nowait(event if self.tag is None else (self.tag, event))


class CoreFacts:
    """The limits ``api.py`` validates against (a ``ServingBackend``'s read-only part)."""

    def __init__(self, facts: Facts):
        from pdflow.model.tokenizer import load_tokenizer

        self.max_model_len, self.vocab_size = facts.max_model_len, facts.vocab_size
        self.block_size, self.num_kv_blocks = facts.block_size, facts.num_kv_blocks
        folder = facts.tokenizer_folder
        self.tokenizer = load_tokenizer(Path(folder)) if folder is not None else None


class EngineClient:
    def __init__(self, address: str, *, front: int, core_pid: int):
        self.front, self.core_pid = front, core_pid
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"front-{front}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a Submit or an Abort
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.streams: dict[str, RemoteTicket] = {}
        self.replies: dict[int, asyncio.Future] = {}
        self.error: str | None = None
        self.facts: CoreFacts | None = None
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> EngineClient:
        """Say hello, watch the core, and wait for its facts (the engine is up)."""
        self._send(Hello(front=self.front))
        self._tasks.append(asyncio.create_task(self._read()))
        pidfd = os.pidfd_open(self.core_pid)
        asyncio.get_running_loop().add_reader(pidfd, self._core_exited, pidfd)
        reply = await self.query("facts")
        self.facts = CoreFacts(reply.facts)
        return self

    @property
    def healthy(self) -> bool:
        return self.error is None and self.facts is not None

    def open_stream(self, prompt_token_ids: list[int], sampling: SamplingParams, *,
                    into: asyncio.Queue | None = None, tag: int = 0,
                    route: PDRoute | None = None) -> tuple[RemoteTicket, asyncio.Queue]:
        """As ``EngineLoop.open_stream``: events on the returned queue, or ``(tag, event)``
        on ``into``. The core's engines serve every request whole: a ``route`` is refused
        (a 400 event, as a backend's refusal is in process)."""
        rid = f"{self.front}-{next(self._ids)}"
        ticket = RemoteTicket(rid=rid, events=asyncio.Queue() if into is None else into,
                              text=TextStream(self.facts.tokenizer, sampling.stop), tag=None if into is None else tag)
        if route is not None:
            ticket.put(StreamEvent(error="this server's engine core serves every request whole; it cannot take "
                                   "a P/D route (P/D instances: serve.role=prefill|decode)", error_status=400))
            return ticket, ticket.events
        if self.error is not None:
            ticket.put(StreamEvent(error=self.error, error_status=503))
            return ticket, ticket.events
        self.streams[rid] = ticket
        self._send(Submit(rid=rid, prompt_token_ids=list(prompt_token_ids), sampling=sampling))
        return ticket, ticket.events

    def abort(self, ticket: RemoteTicket) -> None:
        if self.streams.pop(ticket.rid, None) is not None:
            self._send(Abort(rid=ticket.rid))

    def count(self, outcome: str) -> None:
        """A request's outcome, for the core's metrics."""
        if self.error is None:
            self._send(Outcome(outcome=outcome))

    async def query(self, what: str) -> Reply:
        qid = next(self._ids)
        future = self.replies[qid] = asyncio.get_running_loop().create_future()
        self._send(Query(qid=qid, what=what))
        try:
            return await future
        finally:
            self.replies.pop(qid, None)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close(linger=0)

    # -- inside ------------------------------------------------------------------------

    def _send(self, msg) -> None:
        self.sock.send(encode(msg))  # a DEALER queues; never awaited on the request's path

    async def _read(self) -> None:
        while True:
            msg = front_decoder.decode(await self.sock.recv())
            if isinstance(msg, Steps):
                for delta in msg.deltas:
                    ticket = self.streams.get(delta.rid)
                    if ticket is None:  # aborted here after the core produced it
                        continue
                    done = delta.finish_reason is not None or delta.error is not None
                    event = to_event(delta, ticket.text.push(delta.token_ids, finished=done))
                    if done:
                        del self.streams[delta.rid]
                    ticket.put(event)
            elif isinstance(msg, Reply):
                future = self.replies.get(msg.qid)
                if future is not None and not future.done():
                    future.set_result(msg)

    def _core_exited(self, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        self.error = "the engine core process exited; this server is stopping"
        for ticket in self.streams.values():
            ticket.put(StreamEvent(error=self.error, error_status=503))
        self.streams.clear()
        for future in self.replies.values():
            with contextlib.suppress(asyncio.InvalidStateError):
                future.set_exception(RuntimeError(self.error))
