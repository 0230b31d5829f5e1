"""Faults at the transfer layer end one request, in time, and never the process.

A producer or consumer instance runs in a second process (``transfer_peer.py``) where a
peer must die; the rest run in this process. Everything goes over real Mooncake (TCP
loopback) and the real ZMQ side channel.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transfer_kit
from transfer_kit import (
    POISON,
    ConsumerSide,
    ProducerSide,
    Rig,
    needs_mooncake,
    producer_caches_of,
    wrong_units,
)

from pdflow.transfer import KVDone, KVWanted

pytestmark = needs_mooncake
transports = transfer_kit.transports  # the pooled-engine fixture
one_torch_thread = transfer_kit.one_torch_thread

NUM_BLOCKS = 6
OVERRIDES = ["prefill=pp2", "decode=tp2", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
             "transfer.staging_mib=16", "transfer.timeout_s=3", "transfer.retry_backoff_s=0.05"]


@contextmanager
def peer(role: str, tmp_path: Path, **args):
    """A ``transfer_peer.py`` process; yields (process, its ready line as JSON)."""
    log = open(tmp_path / f"{role}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("transfer_peer.py")), role,
         json.dumps({"overrides": OVERRIDES, "num_blocks": NUM_BLOCKS, **args})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "WARNING"})
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline() if sel.select(timeout=240) else ""
        if not line:
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"{role} peer never got ready:\n{(tmp_path / f'{role}.log').read_text()[-3000:]}")
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()


@pytest.mark.slow
def test_two_processes_then_a_killed_producer_ends_the_request_by_its_deadline(graph_of, transports, tmp_path):
    graph = graph_of(*OVERRIDES)
    consumer = ConsumerSide(graph, NUM_BLOCKS, transports)
    try:
        with peer("producer", tmp_path) as (proc, ready):
            producers = {int(r): a for r, a in ready["addresses"].items()}
            consumer.pair(producers)
            consumer.ask(producers, {"a:4.0.3": [1, 5, 2], "b:1": [0]})
            outcomes = consumer.collect(4)
            assert sorted(o.ok for o in outcomes.values()) == [True] * 4
            assert wrong_units(graph, producer_caches_of(graph, NUM_BLOCKS), consumer.caches,
                               [([4, 0, 3], [1, 5, 2]), ([1], [0])]) == []
            proc.kill()
            proc.wait(30)
            start = time.monotonic()
            consumer.ask(producers, {"c:2": [3]})
            lost = consumer.collect(2, timeout_s=30)
        assert time.monotonic() - start < 3 + 10  # the request's 3 s deadline, not a hang
        assert [(o.ok, "did not report" in o.error) for o in lost.values()] == [(False, True)] * 2
        for importer in consumer.importers.values():
            assert importer.in_flight == 0
            assert importer.receive.arena.used > 0  # a dead producer might still write: held
            importer.expire(now=max(o.reuse_after for o in lost.values()) + 1)
            assert importer.receive.arena.used == 0
    finally:
        consumer.close()


@pytest.mark.slow
def test_a_dead_consumer_fails_the_write_in_time_and_the_producer_serves_on(graph_of, transports, tmp_path):
    graph = graph_of(*OVERRIDES)
    blocks = {"live:1": [1]}
    producer = ProducerSide(graph, NUM_BLOCKS, transports, lambda rid: blocks.get(rid, [0]))
    try:
        with peer("consumer", tmp_path, producers=producer.addresses) as (proc, _):
            exporter = producer.exporters[0]
            exporter.probes[("decode-0", 0)].result(timeout=10)  # the engine session is open
            proc.kill()
            proc.wait(30)
            want = KVWanted(request_id="dead:0", instance="decode-0", consumer_rank=0,
                            reply_to="tcp://127.0.0.1:1", block_ids=[2], nonce=5, deadline=time.time() + 30)
            start = time.monotonic()
            done = exporter.export(want, [0])
        assert time.monotonic() - start < 3 + 10
        assert not done.ok and done.nonce == 5 and done.request_id == "dead:0"
        live = ConsumerSide(graph, NUM_BLOCKS, transports, instance="decode-1")
        try:
            live.pair(producer.addresses)
            live.ask(producer.addresses, {"live:1": [4]})
            assert all(o.ok for o in live.collect(2).values())
            assert wrong_units(graph, producer.caches, live.caches, [([1], [4])]) == []
        finally:
            live.close()
    finally:
        producer.close()


def test_a_chunk_error_fails_only_that_request(graph_of, transports):
    """Consumer caches registered two blocks per chunk; one chunk of one unit is dropped.
    The request whose blocks sit there fails (after its retries); the request beside it,
    and the next one, land intact."""
    graph = graph_of(*[o.replace("staging_mib=16", "staging_mib=1") for o in OVERRIDES],
                     "transfer.staging=false", "transfer.descriptor_batch=8", "transfer.timeout_s=20")
    unit = graph.consumer.ranks[0].units[0]
    rig = Rig(graph, NUM_BLOCKS, transports, registration_limit=2 * unit.bytes_per_block)
    try:
        rig.pair()
        importer = rig.importers[0]
        region = importer.regions[unit.name]
        assert region.chunk_blocks == 2
        importer.transport.unregister_chunk(region.block(4))  # blocks 4 and 5 of this unit
        outcomes = rig.move({"bad": ([0, 1], [4, 5]), "good": ([2, 3, 5], [0, 1, 2])})
        after = rig.move({"next": ([4], [3])})
    finally:
        rig.close()
    assert not outcomes[(0, "bad")].ok and "returned -1" in outcomes[(0, "bad")].error
    assert outcomes[(0, "good")].ok and outcomes[(1, "bad")].ok and outcomes[(1, "good")].ok
    assert after[(0, "next")].ok and after[(1, "next")].ok
    landed = [([2, 3, 5], [0, 1, 2]), ([4], [3])]
    assert wrong_units(graph, rig.producer_caches, rig.consumer_caches, landed, blocks_only=True) == []


def test_stale_and_repeated_dones_are_ignored(graph_of, transports):
    graph = graph_of(*OVERRIDES)
    rig = Rig(graph, NUM_BLOCKS, transports)
    try:
        rig.pair()
        importer, endpoint = rig.importers[0], rig.consumer.endpoints[0]
        rig.blocks["r"] = [3]
        wanted = importer.expect("r", [2])
        forged = [KVDone(request_id="r", stage=rig.graph.rank("prefill", p).stage, producer_rank=p,
                         consumer_rank=0, nonce=w.nonce ^ 1, ok=False, error="old attempt")
                  for p, w in wanted.items()]
        assert [importer.on_done(d) for d in forged] == [None] * len(forged)
        assert importer.stale == len(forged) and importer.in_flight == 1
        for p, want in wanted.items():
            endpoint.send(rig.producer_address(p), want)
        dones = [endpoint.recv(10.0) for _ in wanted]
        outcomes = [importer.on_done(d) for d in dones]
        assert outcomes[:-1] == [None] * (len(dones) - 1) and outcomes[-1].ok
        assert importer.on_done(dones[0]) is None and importer.stale == len(forged) + 1
    finally:
        rig.close()
    only_rank0 = {0: rig.consumer_caches[0]}
    assert wrong_units(graph, rig.producer_caches, only_rank0, [([3], [2])]) == []


def test_a_request_nobody_serves_times_out_and_a_late_report_frees_its_slot(graph_of, transports):
    graph = graph_of(*[o.replace("timeout_s=3", "timeout_s=0.5") for o in OVERRIDES])
    rig = Rig(graph, NUM_BLOCKS, transports)
    try:
        importer = rig.importers[0]
        wanted = importer.expect("lost", [1, 2])  # never sent: no producer will answer
        assert importer.expire() == []
        time.sleep(0.6)
        [outcome] = importer.expire()
        assert not outcome.ok and outcome.block_ids == (1, 2) and outcome.reuse_after > time.monotonic()
        assert importer.receive.arena.used > 0 and importer.in_flight == 0
        first, *rest = wanted.items()
        late = KVDone(request_id="lost", stage=0, producer_rank=first[0], consumer_rank=0,
                      nonce=first[1].nonce, ok=True)
        assert importer.on_done(late) is None
        used = importer.receive.arena.used
        assert used > 0 if rest else used == 0
        importer.expire(now=outcome.reuse_after + 0.01)
        assert importer.receive.arena.used == 0
        assert all(torch.all(c.view(torch.uint8) == POISON) for c in rig.consumer_caches[0].values())
    finally:
        rig.close()
