"""A peer that stalls under a ``transfer=nccl`` pair between two GPUs. A consumer rank stopped
with its connection open: the producer rank's send fails with ``TransferError`` at the
transfer deadline and the producer lives on; once the consumer runs again, the broken pair
pairs again (a new NCCL group) and the next request lands. A producer that announces a request and sends
none of it: the consumer rank gives the request up at the deadline and lives on, and
serves the next pair. Without the abort of the broken pair's NCCL group, the operations
left waiting on the GPU are found by torch's watchdog at the group's timeout, which ends
that whole process (every other pair and request of the rank with it)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

KEY = bytes(32)  # the listeners' pairing key (``transfer.grants``)


def send(peer, src, dst) -> None:
    from pdflow.transfer.grants import kv_nonce

    peer.send(src, dst, "r", kv_nonce(KEY, dst))


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

TIMEOUT_S = 5
# A request far larger than NCCL's own buffers (Llama-3-8B heads, 4,096 tokens: 256 MiB per
# consumer rank): a small send completes into them with nobody receiving.
BLOCKS = 32
BUFFER_BYTES = 64 << 20
OVERRIDES = ["model=llama3-8b", "prefill=tp1", "decode=tp2", "drafter=none", "transfer=nccl",
             f"transfer.timeout_s={TIMEOUT_S}", "prefill.device=cuda", "decode.device=cuda",
             "prefill.block_size=128", "decode.block_size=128", "prefill.kv_page_tokens=128",
             "decode.kv_page_tokens=128"]


def _graph():
    from pdflow import compose
    from pdflow.graph import build_graph

    return build_graph(compose(OVERRIDES))


def _caches(units, device):
    from pdflow.attention.kv_cache import TORCH_DTYPES

    return {u.name: torch.zeros(u.cache_shape(BLOCKS), dtype=TORCH_DTYPES[u.dtype], device=device) for u in units}


def _consumer(outbox) -> None:
    """Decode rank 1 on GPU 1: listens, then waits to be killed."""
    from pdflow.graph import CONSUMER
    from pdflow.transfer.p2p import P2PListener, device_identity

    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    graph = _graph()
    listener = P2PListener(key=KEY, graph=graph, rank=1, caches=_caches(graph.rank(CONSUMER, 1).units, device),
                           spec=graph.spec.transfer, buffer_bytes=BUFFER_BYTES)
    outbox.put(("listening", listener.address, device_identity(device)))
    time.sleep(600)


def _pair(address: str, identity: str, caches=None):
    """Prefill rank 0 on GPU 0, paired with decode rank 1 (over NCCL)."""
    from pdflow.graph import CONSUMER, PRODUCER
    from pdflow.transfer.grants import pairing_token
    from pdflow.transfer.p2p import P2PPeer

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    graph = _graph()
    caches = caches or _caches(graph.rank(PRODUCER, 0).units, device)
    cut = next(c for c in graph.cuts if c.consumer_rank == 1)
    return P2PPeer(pairing=pairing_token(KEY), address=address, consumer_device=identity, plan=cut.over(set(caches)),
                   caches=caches,
                   dst_block_bytes={u.name: u.bytes_per_block for u in graph.rank(CONSUMER, 1).units},
                   producer_rank=0, spec=graph.spec.transfer)


def _producer(address: str, identity: str, inbox, outbox) -> None:
    """Pairs, sends once told, then outlives the pair group's NCCL timeout (twice the
    deadline) and proves its GPU works."""
    from pdflow.transfer.errors import TransferError

    device = torch.device("cuda", 0)
    peer = _pair(address, identity)
    outbox.put(("paired", peer.mover))
    inbox.get()
    try:
        send(peer, list(range(BLOCKS)), list(range(BLOCKS)))
        outbox.put(("sent", ""))
    except TransferError as err:
        outbox.put(("failed", str(err)))
    time.sleep(3 * TIMEOUT_S)  # failed at ~1x the deadline; the group's NCCL timeout is 2x
    outbox.put(("alive", torch.ones(4, device=device).sum().item()))
    inbox.get()  # the consumer runs again: the broken pair pairs again (a new NCCL group) and lands
    try:
        send(peer, list(range(BLOCKS)), list(range(BLOCKS)))
        outbox.put(("sent again", peer.repairs))
    except TransferError as err:
        outbox.put(("failed again", str(err)))


@contextlib.contextmanager
def _ranks(producer_target):
    """Decode rank 1 (``_consumer``) and prefill rank 0 (``producer_target``) as processes;
    yields (consumer, producer, the producer's inbox, the shared outbox); kills both after."""
    ctx = mp.get_context("spawn")
    outbox, inbox = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_consumer, args=(outbox,), daemon=True)]
    procs[0].start()
    try:
        what, address, identity = outbox.get(timeout=120)
        assert what == "listening"
        procs.append(ctx.Process(target=producer_target, args=(address, identity, inbox, outbox), daemon=True))
        procs[1].start()
        yield procs[0], procs[1], inbox, outbox
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(30)


def test_a_stalled_consumer_fails_the_send_and_the_producer_lives_on():
    with _ranks(_producer) as (consumer, producer, inbox, outbox):
        assert outbox.get(timeout=120) == ("paired", "nccl")
        os.kill(consumer.pid, signal.SIGSTOP)  # alive to TCP, gone to NCCL: the sends are issued and wait
        inbox.put("send")
        what, why = outbox.get(timeout=4 * TIMEOUT_S + 30)
        assert what == "failed", why
        print(f"the send failed: {why}")
        what, value = outbox.get(timeout=4 * TIMEOUT_S + 30)  # the watchdog would have acted by now
        assert (what, value) == ("alive", 4.0)
        assert producer.is_alive()
        os.kill(consumer.pid, signal.SIGCONT)  # its session ends (deadline passed), its listener serves on
        inbox.put("send again")
        assert outbox.get(timeout=4 * TIMEOUT_S + 60) == ("sent again", 1)


def test_a_consumer_that_dies_mid_request_fails_the_send_without_waiting_out_the_deadline():
    """The consumer rank's process dies while the producer's sends wait for it: its control
    connection closes, and the producer's deadline watcher aborts the pair's group then,
    not at ``transfer.timeout_s`` (the failure says which)."""
    with _ranks(_producer) as (consumer, producer, inbox, outbox):
        assert outbox.get(timeout=120) == ("paired", "nccl")
        os.kill(consumer.pid, signal.SIGSTOP)  # the sends are issued and wait
        inbox.put("send")
        time.sleep(1)
        os.kill(consumer.pid, signal.SIGKILL)
        what, why = outbox.get(timeout=4 * TIMEOUT_S + 30)
        assert what == "failed" and "closed the pair's connection" in why, why
        what, value = outbox.get(timeout=4 * TIMEOUT_S + 30)
        assert (what, value) == ("alive", 4.0)


def _stalling_producer(address: str, identity: str, inbox, outbox) -> None:
    """Pairs, announces a request and sends none of its chunks (a producer that hangs or
    dies mid-request); told to, pairs again and sends a whole request."""
    from pdflow.transfer.grants import kv_nonce
    from pdflow.transfer.p2p_messages import P2PRequest

    peer = _pair(address, identity)
    peer.conn.send(P2PRequest(request_id="stalled", dst_blocks=list(range(BLOCKS)), nonce=kv_nonce(KEY, range(BLOCKS))))
    outbox.put(("announced", peer.mover))
    inbox.get()
    fresh = _pair(address, identity, peer.caches)
    send(fresh, list(range(BLOCKS)), list(range(BLOCKS)))
    outbox.put(("sent", fresh.mover))
    time.sleep(600)


def test_a_producer_that_stalls_mid_request_fails_it_and_the_consumer_lives_on():
    with _ranks(_stalling_producer) as (consumer, _, inbox, outbox):
        assert outbox.get(timeout=120) == ("announced", "nccl")
        time.sleep(3 * TIMEOUT_S)  # the consumer's receives wait; the group's NCCL timeout is 2x the deadline
        assert consumer.is_alive(), f"the consumer rank's process ended (exit code {consumer.exitcode})"
        inbox.put("again")
        assert outbox.get(timeout=4 * TIMEOUT_S + 60) == ("sent", "nccl")  # it serves the next pair
