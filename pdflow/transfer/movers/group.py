"""``nccl`` (two GPUs of one host) and ``gloo`` (``transfer=nccl`` with CPU caches): a
two-rank process group made for the pair (a ``FileStore`` rendezvous). The receive buffer
is two halves: chunk i+1 is packed (received) into one while chunk i is on the wire from
(scattered from) the other; the consumer's word on a request is an 8-byte verdict on the
group itself, in stream order after its last scatter (an error's text follows on the
socket). A stalled or dead peer is the pair's armed ``GroupDeadline``'s."""

from __future__ import annotations

import datetime
import os
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pdflow.transfer.errors import TransferError
from pdflow.transfer.movers.protocol import Receiver, Sender
from pdflow.transfer.p2p_messages import P2PAck, P2PHello, P2PReady, P2PRequest
from pdflow.transfer.p2p_parts import Phases, size_of, synchronize
from pdflow.transfer.packing import Piece


def pair_group(mover: str, store_path: str, rank: int, timeout_s: float, probe: torch.Tensor) -> dist.ProcessGroup:
    """The pair's two-rank group (rank 1 the producer), connected before it returns:
    ``probe`` (half its buffer, the largest message it carries) crosses it. NCCL connects
    on the first operation, mapping device memory behind kernels already running; built
    during traffic, two ranks can wait on each other for good (seen at PP4 -> TP4;
    NVIDIA/nccl#195). A peer that never joins is a ``TransferError``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.FileStore(store_path, 2)
        store.set_timeout(timeout)
        if mover == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            opts._timeout = timeout
            group = dist.ProcessGroupGloo(store, rank, 2, opts)
            probe = probe[:8]
        else:
            opts = dist.ProcessGroupNCCL.Options()
            # Twice the transfer deadline: a stalled peer is found first by the host (the ack
            # or a chunk that does not come in ``timeout_s``), which aborts the group
            # (``abort_group``) before torch's watchdog would end the process.
            opts._timeout = 2 * timeout
            group = dist.ProcessGroupNCCL(store, rank, 2, opts)
        (group.send if rank == 1 else group.recv)([probe], 1 - rank, 0).wait()
        synchronize(probe.device)
    except RuntimeError as err:  # torch.distributed's store, backend and timeout errors
        raise TransferError(f"the pair's {mover} group did not connect within {timeout_s} s: "
                            f"{type(err).__name__}: {err}") from err
    return group


def two_halves(buf: torch.Tensor) -> list[torch.Tensor]:
    """A pipelined pair's two slots: chunk i+1 fills one while chunk i moves."""
    half = buf.numel() // 2
    return [buf[:half], buf[half:2 * half]]


class GroupSender(Sender):
    buf: torch.Tensor | None = None

    def set_up(self, ready: P2PReady) -> None:
        peer = self.peer
        self.buffer_bytes = ready.buffer_bytes
        self.buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=peer.device)
        self.group = pair_group(peer.mover, ready.store_path, 1, peer.timeout_s, self.buf[:self.buffer_bytes // 2])
        self.halves = two_halves(self.buf)  # ``send``'s two slots
        # The consumer's verdict on each request (``_verdict``), and its host copy.
        self.verdict = torch.zeros(1, dtype=torch.int64, device=peer.device)
        self.verdict_host = self.verdict if peer.device.type != "cuda" else torch.zeros(
            1, dtype=torch.int64, pin_memory=True)
        self.verdict_stream = torch.cuda.Stream(peer.device) if peer.device.type == "cuda" else None
        self._sending: list = [None, None]  # the last send out of each half of ``buf``

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str, nonce: int,
             phases: Phases) -> None:
        """Pack chunk i+1 into one half of ``buf`` while chunk i is on the wire from the
        other, then wait for the consumer's verdict."""
        ids = self.announce(src_blocks, dst_blocks, request_id, nonce, phases)
        peer = self.peer
        parts = peer._chunks(len(src_blocks), self.buffer_bytes // 2, peer.ramp)
        with peer.deadline.armed(peer.timeout_s) as aborted:  # a consumer that stalls or dies
            for i, chunk in enumerate(parts):
                if self._sending[i % 2] is not None:
                    self._sending[i % 2].wait()  # that half's last send left (NCCL: the stream waits)
                phases.mark("wait")
                self.pack(chunk, self.halves[i % 2], src_blocks, ids)
                phases.mark("pack")
                self._sending[i % 2] = self.group.send([self.halves[i % 2][:size_of(chunk)]], 0, 0)
                phases.mark("send")
            failed = self._verdict()
        if aborted():
            why = ("the consumer closed the pair's connection mid-request" if peer.deadline.peer_left
                   else f"the consumer's verdict did not come within {peer.timeout_s} s")
            raise ConnectionError(f"request {request_id!r}: {why}; the pair's group was aborted")
        self._sending = [None, None]  # the verdict came after every send of the request ended
        phases.mark("verdict")
        if failed:
            self.ack(max(len(parts) - 1, 0))  # its error, on the control socket
            raise ConnectionError(f"the consumer's verdict on request {request_id!r} was a failure, but its "
                                  "ack said none")
        phases.report()

    def _verdict(self) -> bool:
        """Wait for the consumer's 8-byte verdict on the pair's group (whether the request
        failed), sent in stream order after its last scatter: no host step and no socket on
        the path (a failure's text follows on the socket). On a stream of its own: this
        rank's stream may already hold its next step's work."""
        with torch.cuda.stream(self.verdict_stream):  # no stream (CPU): a no-op
            self.group.recv([self.verdict], 0, 0).wait()
            if self.verdict_stream is not None:
                self.verdict_host.copy_(self.verdict, non_blocking=True)
                self.verdict_stream.synchronize()
        return bool(int(self.verdict_host[0]))

    def release(self) -> None:
        self.buf = self.group = None


class GroupReceiver(Receiver):
    buf: torch.Tensor | None = None

    def set_up(self, hello: P2PHello, buffer_bytes: int) -> P2PReady:
        lis = self.session.listener
        self.buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=lis.device)
        self.slots = two_halves(self.buf)  # the pipeline's two slots, and its verdicts: ok (0), failed (1)
        self.verdicts = [torch.tensor([v], dtype=torch.int64, device=lis.device) for v in (0, 1)]
        path = os.path.join(lis._dir, f"pair-{hello.producer_rank}-{uuid.uuid4().hex}")
        return P2PReady(buffer_bytes=buffer_bytes, store_path=path)

    def connect(self, hello: P2PHello, ready: P2PReady) -> None:
        """Both ends meet in the group's rendezvous."""
        lis = self.session.listener
        if lis.device.type == "cuda":
            torch.cuda.set_device(lis.device)
        self.group = pair_group(hello.mover, ready.store_path, 0, lis.spec.timeout_s, self.buf[:self.buf.numel() // 2])

    def _parts(self, num_blocks: int) -> list[list[Piece]]:
        """A request's chunks (each fits one of ``slots``)."""
        return self.session.chunks(num_blocks, self.slots[0].numel(), self.session.listener.spec.chunk_ramp)

    def post_first(self, blocks: list[int]) -> dict:
        """The receive of the first chunk (both halves are free: the last request
        synchronized): the producer's first chunk cannot leave before it is posted."""
        parts = self._parts(len(blocks))
        return {0: self.group.recv([self.slots[0][:size_of(parts[0])]], 1, 0)} if parts else {}

    def receive(self, request: P2PRequest, error: str, pending: dict, phases: Phases) -> None:
        """Receive chunk i+1 into one half of the buffer while chunk i is scattered from the
        other, then send the verdict (``GroupSender._verdict``). The first chunk's receive
        is already ``pending``."""
        session, group = self.session, self.group
        blocks = request.dst_blocks
        parts, slots = self._parts(len(blocks)), self.slots

        def post(i: int) -> None:
            pending[i] = group.recv([slots[i % 2][:size_of(parts[i])]], 1, 0)

        phases.mark("posted")
        timeout_s = session.listener.spec.timeout_s
        with session.deadline.armed(timeout_s) as aborted:  # a producer that stalls or dies mid-request
            if len(parts) > 1:
                post(1)  # chunk 1 leaves after chunk 0 is through: posted after the first
            ids = session.block_ids(blocks, error)
            phases.mark("ids")
            for i, chunk in enumerate(parts):
                if 2 <= i + 1 < len(parts):
                    post(i + 1)  # after chunk i-1's scatter in stream order: its half is free
                pending.pop(i).wait()
                phases.mark("recv")
                error = error or session.scatter(chunk, slots[i % 2], blocks, ids)
                phases.mark("scatter")
            if not error:
                session.listener.landed += 1  # counted before the verdict: the producer may look once it has it
            # The verdict, after the last scatter in stream order.
            group.send([self.verdicts[bool(error)]], 1, 0).wait()
            phases.mark("verdict")
            synchronize(session.listener.device)  # off the producer's path: its half-buffers are free again
        if aborted():
            if not error:
                session.listener.landed -= 1  # counted above; the verdict may never have left
            why = ("the producer closed the pair's connection mid-request" if session.deadline.peer_left
                   else f"the producer's chunks did not all come within {timeout_s} s")
            raise ConnectionError(f"request {request.request_id!r}: {why}; the pair's group was aborted")
        phases.mark("synced")
        if error:
            session.conn.send(P2PAck(index=max(len(parts) - 1, 0), error=error))
        phases.report()
