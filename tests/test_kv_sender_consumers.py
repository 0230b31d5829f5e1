"""One producer rank's sender serving two consumer instances (issue 29): each consumer has
a queue and a thread of its own, so a consumer whose write cannot complete (held here by
``PDFLOW_TEST_FAULT=export:prefill:0@<consumer>:hold`` inside its write lanes, as a slow
or SIGKILLed decode instance holds them up to ``transfer.timeout_s``) holds back only its
own exports: the other's, started after it, land byte for byte meanwhile. Forgetting or
re-pairing a consumer (``ForgetConsumer``/``PairConsumer`` through ``handle_control``, as
a rank answers them) waits for that consumer's exports in flight only, never another's.
Real links (the nccl-on-CPU pairs of ``test_kv_peer_table``); the order comes from hold
files and reports, never a clock. With one sender thread for every consumer each test
waits out its bounded report wait and fails."""

from __future__ import annotations

import threading

import pytest
import torch
from test_kv_peer_table import BASE, NUM_BLOCKS, REQUESTS, Consumer, _export
from transfer_kit import producer_caches_of, wrong_units

from pdflow.graph import PRODUCER
from pdflow.parallel.messages import ForgetConsumer, Forgot, PairConsumer, Paired
from pdflow.worker import faults
from pdflow.worker.control import handle_control
from pdflow.worker.kv_link import KVLink
from pdflow.worker.kv_sender import KVSender
from pdflow.worker.stage import build_stage

CPU = torch.device("cpu")
REPORT_WAIT_S = 60.0  # a bound on each wait for a report, never a measure


@pytest.fixture
def hold(tmp_path, monkeypatch):
    """``hold(cid)``: every write to consumer ``cid`` waits for the returned file (touched
    at the end in any case, so nothing stays held past the test)."""
    release = tmp_path / "release"
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))

    def make(cid: str):
        monkeypatch.setenv(faults.ENV, f"export:prefill:0@{cid}:hold")
        return release

    yield make
    release.touch()


@pytest.fixture
def consumers(graph_of):
    graph = graph_of(*BASE)
    made = {cid: Consumer(graph) for cid in REQUESTS}
    try:
        yield graph, made
    finally:
        for link in (lk for c in made.values() for lk in c.links):
            link.close()


def _reports(take, ids: set[str]) -> list:
    """Reports from ``take(wait_s)`` until they cover ``ids`` or one wait brings none."""
    got = []
    while not ids <= {r for sent in got for r in sent.request_ids}:
        more = take(REPORT_WAIT_S)
        if not more:
            break
        got += more
    return got


def _landed(sents, ids: set[str]) -> bool:
    return ids <= {r for sent in sents for r in sent.request_ids if r not in sent.failed}


def test_a_held_consumer_does_not_hold_back_another_consumers_exports(consumers, hold):
    graph, made = consumers
    sources = producer_caches_of(graph, NUM_BLOCKS)
    producer = KVLink(graph, PRODUCER, 0, sources[0])
    for cid, consumer in made.items():
        producer.pair(consumer.endpoints(), cid)
    release = hold("d0")
    sender = KVSender(producer, role=PRODUCER, rank=0, device=CPU)
    try:
        first = _export("d0", made["d0"], 0, *REQUESTS["d0"][0])
        sender.start([first])  # a step's export to d0: its writes wait for the file
        later = [_export("d1", made["d1"], i, *REQUESTS["d1"][i]) for i in range(2)]
        sender.start(later)  # the next step's, to d1
        sents = _reports(sender.settled, {e.request_id for e in later})
        assert _landed(sents, {e.request_id for e in later}), sents
        assert all("d0-0" not in sent.request_ids for sent in sents)
        assert wrong_units(graph, sources, made["d1"].caches, REQUESTS["d1"]) == []
        assert wrong_units(graph, sources, made["d0"].caches, []) == []  # d0's still held: all poison
        assert sender.busy
        release.touch()
        sender.drain(timeout_s=REPORT_WAIT_S)
        (sent,) = sender.settled()
        assert sent.request_ids == ["d0-0"] and sent.failed == {}
        assert wrong_units(graph, sources, made["d0"].caches, [REQUESTS["d0"][0]]) == []
    finally:
        release.touch()
        sender.close()
        producer.close()


@pytest.fixture
def stage(consumers):
    """A producer rank's stage (the shipped tiny model, its pool filled with random bytes)
    answering control messages as a rank does."""
    graph, _ = consumers
    built = build_stage(graph, PRODUCER, 0, CPU)
    gen = torch.Generator().manual_seed(1)
    for cache in built.kv_caches().values():
        raw = cache.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    try:
        yield built
    finally:
        built.release()


def _control(graph, stage, msg):
    return handle_control(stage, graph, PRODUCER, 0, msg)


def _pair(graph, stage, made, cid):
    return _control(graph, stage, PairConsumer(endpoints=made[cid].endpoints(), consumer=cid))


def test_forgetting_or_pairing_one_consumer_again_does_not_wait_for_another_consumers_exports(
        consumers, stage, hold):
    graph, made = consumers
    sources = {0: stage.kv_caches()}
    release = hold("d1")
    try:
        assert [_pair(graph, stage, made, cid) for cid in made] == [Paired(rank=0)] * 2
        stage.export([_export(cid, made[cid], 0, *REQUESTS[cid][0]) for cid in made])  # one step, both
        assert _control(graph, stage, ForgetConsumer(consumer="d0")) == Forgot(rank=0, held=True)
        # d0's export settled before its peers closed; d1's is still held, and was not waited for.
        assert wrong_units(graph, sources, made["d1"].caches, []) == []
        assert wrong_units(graph, sources, made["d0"].caches, [REQUESTS["d0"][0]]) == []
        (sent,) = stage.settled()
        assert sent.request_ids == ["d0-0"] and sent.failed == {}
        assert _pair(graph, stage, made, "d0") == Paired(rank=0)  # d0 back, d1's still held
        stage.export([_export("d0", made["d0"], 1, *REQUESTS["d0"][1])])
        assert _landed(_reports(stage.settled, {"d0-1"}), {"d0-1"})
        assert _pair(graph, stage, made, "d0") == Paired(rank=0)  # paired again: closes d0's thread only
        assert wrong_units(graph, sources, made["d1"].caches, []) == [] and stage.sender.busy
        release.touch()
        stage.export([_export("d1", made["d1"], 1, *REQUESTS["d1"][1])])
        assert _landed(_reports(stage.settled, {"d1-0", "d1-1"}), {"d1-0", "d1-1"})
        assert wrong_units(graph, sources, made["d1"].caches, REQUESTS["d1"]) == []
        assert wrong_units(graph, sources, made["d0"].caches, REQUESTS["d0"]) == []
    finally:
        release.touch()


def test_another_consumers_exports_land_while_a_forgotten_consumers_export_settles(consumers, stage, hold):
    """The rank waits for the forgotten consumer's export in flight (its blocks are read
    until then); the other consumer's, queued behind it, land meanwhile and after."""
    graph, made = consumers
    sources = {0: stage.kv_caches()}
    release = hold("d0")
    answers = []
    forget = threading.Thread(target=lambda: answers.append(_control(graph, stage, ForgetConsumer(consumer="d0"))))
    try:
        assert [_pair(graph, stage, made, cid) for cid in made] == [Paired(rank=0)] * 2
        stage.export([_export("d0", made["d0"], 0, *REQUESTS["d0"][0])])
        stage.export([_export("d1", made["d1"], 0, *REQUESTS["d1"][0])])
        forget.start()  # waits for d0's held export
        assert _landed(_reports(stage.settled, {"d1-0"}), {"d1-0"})
        assert wrong_units(graph, sources, made["d1"].caches, [REQUESTS["d1"][0]]) == []
        assert wrong_units(graph, sources, made["d0"].caches, []) == []
        assert answers == []  # d0's export still held: the forget has not answered
        release.touch()
        forget.join(timeout=REPORT_WAIT_S)
        assert answers == [Forgot(rank=0, held=True)]
        assert _landed(_reports(stage.settled, {"d0-0"}), {"d0-0"})  # reported, kept for the owner
        assert wrong_units(graph, sources, made["d0"].caches, [REQUESTS["d0"][0]]) == []
        stage.export([_export("d1", made["d1"], 1, *REQUESTS["d1"][1])])
        assert _landed(_reports(stage.settled, {"d1-1"}), {"d1-1"})
        assert wrong_units(graph, sources, made["d1"].caches, REQUESTS["d1"]) == []
    finally:
        release.touch()
        if forget.is_alive():
            forget.join(timeout=REPORT_WAIT_S)


def test_an_in_process_owner_is_told_when_an_export_settles():
    """``on_settle`` is called on the consumer's thread after the report is kept (a served
    prefill instance's loop wakes on it instead of finding the export on its next 2 ms
    poll); a failed write settles, and tells, too. Without the call the wait times out."""
    from pdflow.parallel.messages import KVExport

    told = threading.Event()
    sender = KVSender(None, role=PRODUCER, rank=0, device=CPU, on_settle=told.set)
    try:
        sender.start([KVExport(request_id="a", consumer="c", nonce=1, src_blocks=[0], dst_blocks=[0])])
        assert told.wait(REPORT_WAIT_S)
        (sent,) = sender.settled()
        assert sent.request_ids == ["a"] and "no KV link" in sent.failed["a"]
    finally:
        sender.close()


def test_the_in_process_executor_hands_its_settle_callback_to_the_stages_sender(graph_of):
    from pdflow.worker.executors import InProcessExecutor

    executor = InProcessExecutor(graph_of(*BASE), PRODUCER)
    try:
        calls = []
        executor.on_settled(lambda: calls.append("first"))
        assert executor.stage.on_settle is not None
        executor.stage.export([])  # the sender, made at the first export, calls the stage's hook
        executor.stage.sender._on_settle()
        executor.on_settled(lambda: calls.append("second"))  # set after the sender exists
        executor.stage.sender._on_settle()
        assert calls == ["first", "second"]
    finally:
        executor.shutdown()
