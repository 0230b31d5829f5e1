"""The KV transfer off the forward (issue 29): a producer rank hands a step's exports to
its sender and steps on; the owner learns they settled on a later step, and holds the
producer's blocks until then.

An export held in flight (``PDFLOW_TEST_FAULT=export:...:hold``, released by a file the
test writes) must not stop the producer: a second prompt's prefill step computes and comes
back meanwhile, the first request waits in ``SENDING_KV`` with its blocks held, and after
the release both land and decode to one process's greedy tokens, every block back. With
the export inside the forward (the code before) the producer's step would not come back
until the release, and the test fails.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from pd_gpu_kit import GPU_BASE

from pdflow import Deployment, SamplingParams, compose
from pdflow.engine.sequence import KVTarget, SequenceStatus
from pdflow.worker import faults

SETTLE_WAIT_S = 30.0  # a liveness bound: the release lands within a second
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
BASE = ["drafter=none", "transfer=nccl", "transfer.timeout_s=20", "transfer.staging_mib=1",
        "prefill.block_size=32", "decode.block_size=32", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
        "prefill.num_kv_blocks=24", "decode.num_kv_blocks=24", "prefill.max_num_batched_tokens=64",
        "decode.max_num_batched_tokens=64", "prefill.enable_prefix_caching=false", "decode=tp1"]


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (60, 40)]


def _monolithic(prompts, device=()):
    with Deployment(compose([*BASE, "prefill=tp1", *device, "mode=monolithic"])) as d:
        return [o.token_ids for o in d.generate(prompts, GREEDY)]


def _admit(d, rid, prompt):
    blocks = d.consumer.add_remote_request(prompt, GREEDY, rid)
    first = dataclasses.replace(GREEDY, max_tokens=1)
    target = KVTarget(blocks=tuple(blocks), nonce=d.consumer.instance.kv_nonce(blocks))  # the consumer's grant
    d.producer.add_request(prompt, first, rid, kv_target=target)


def _decode(d, firsts):
    """The consumer decodes on from each landed prompt; every request's tokens."""
    tokens = {}
    for out in firsts:
        assert out.kv_settled and out.kv_error is None, out
        tokens[out.request_id] = [d.consumer.complete_remote_prefill(out.request_id, out.token_id,
                                                                     out.logprob).token_id]
    while d.consumer.has_unfinished():
        for out in d.consumer.step():
            tokens[out.request_id].append(out.token_id)
    return tokens


# One GPU, both instances in this process (the ``ipc`` mover): the sender's lane stream
# must wait on the forward's event, or it packs KV not yet written and the tokens differ.
ONE_GPU = [*GPU_BASE, "decode.device_offset=0"]
CASES = {
    "tp1": ["prefill=tp1"],
    "pp2": ["prefill=pp2"],
    "tp1-cuda": pytest.param(["prefill=tp1", *ONE_GPU], marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
}


@pytest.mark.slow
@pytest.mark.parametrize("prefill", list(CASES.values()), ids=list(CASES))
def test_a_held_export_does_not_stop_the_producer_and_lands_as_one_process(prefill, tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv(faults.ENV, "export:prefill:0:hold")
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))
    prompts = _prompts()
    spec = compose([*BASE, *prefill, "prefill.step_timeout_s=60"])
    with Deployment(spec) as d:
        producer = d.producer
        _admit(d, "a", prompts[0])
        producer.submit()  # a's prompt fits one step: its export leaves with it
        assert producer.collect(wait=False) == [] and producer.steps == 1
        a = producer.scheduler.find("a")
        assert a.status is SequenceStatus.SENDING_KV and a.block_table  # blocks held while sent
        held = producer.num_free_kv_blocks
        assert held < producer.num_kv_blocks
        _admit(d, "b", prompts[1])
        producer.submit()  # b's prefill computes and comes back while a's KV is still held
        assert producer.collect(wait=False) == [] and producer.steps == 2
        assert a.status is SequenceStatus.SENDING_KV
        assert producer.scheduler.find("b").status is SequenceStatus.SENDING_KV
        release.touch()
        firsts = []
        while producer.has_unfinished():
            firsts += producer.step()
        assert sorted(o.request_id for o in firsts) == ["a", "b"]
        assert producer.num_free_kv_blocks == producer.num_kv_blocks
        tokens = _decode(d, firsts)
        assert d.consumer.num_free_kv_blocks == d.consumer.num_kv_blocks
    assert [tokens["a"], tokens["b"]] == _monolithic(prompts, prefill[1:])


@pytest.mark.slow
@pytest.mark.parametrize("prefill", [["prefill=tp1"], ["prefill=pp2"]], ids=["in-process", "rank-processes"])
def test_the_owner_is_told_when_an_export_settles_without_stepping(prefill, tmp_path, monkeypatch):
    """``Executor.on_settled``'s callback (a served prefill instance's wake) runs when the
    held export is released, while the owner does nothing: the in-process sender calls it,
    and for ranks of their own a watch on their pipes does (with the no-op it replaced, the
    wait runs out)."""
    release = tmp_path / "release"
    monkeypatch.setenv(faults.ENV, "export:prefill:0:hold")
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))
    with Deployment(compose([*BASE, *prefill, "prefill.step_timeout_s=60"])) as d:
        producer, told = d.producer, threading.Event()
        producer.executor.on_settled(lambda: None)
        producer.executor.on_settled(told.set)  # a later call replaces the callback
        _admit(d, "a", _prompts()[0])
        producer.submit()
        assert producer.collect(wait=False) == []  # sent, held: nothing settled yet
        time.sleep(0.3)  # under PP the other stage's rank reports its part meanwhile (it woke the watch)
        assert producer.collect(wait=False) == []  # read: still held on rank 0
        told.clear()
        assert not told.wait(0.3)  # nothing more comes while it is held
        release.touch()
        assert told.wait(SETTLE_WAIT_S)  # the owner has not stepped since
        firsts = []
        while producer.has_unfinished():
            firsts += producer.step()
        assert [o.request_id for o in firsts] == ["a"] and firsts[0].kv_error is None


@pytest.mark.slow
def test_an_abort_while_the_export_is_held_frees_the_blocks_only_once_it_settles(tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv(faults.ENV, "export:prefill:0:hold")
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))
    with Deployment(compose([*BASE, "prefill=tp1"])) as d:
        producer = d.producer
        _admit(d, "a", _prompts()[0])
        producer.submit()
        assert producer.collect(wait=False) == []
        assert producer.abort("a")
        assert producer.num_free_kv_blocks < producer.num_kv_blocks  # the sender still reads them
        release.touch()
        while producer.has_unfinished():
            assert producer.step() == []  # aborted: no token reported
        assert producer.num_free_kv_blocks == producer.num_kv_blocks
        assert d.consumer.fail_remote("a", "abort")
        assert d.consumer.num_free_kv_blocks == d.consumer.num_kv_blocks


@pytest.mark.slow
def test_a_deployment_abort_while_the_export_is_held_keeps_the_consumers_blocks_until_it_settles(
        tmp_path, monkeypatch):
    """``Deployment.abort`` drops the request at the producer, but its export is on the
    wire: the consumer's blocks stay taken until it settles (freed at once, the late
    write would land in reused blocks), then the request ends 'abort' and both pools are
    whole."""
    release = tmp_path / "release"
    monkeypatch.setenv(faults.ENV, "export:prefill:0:hold")
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))
    with Deployment(compose([*BASE, "prefill=tp1"])) as d:
        [rid] = d.submit([_prompts()[0]], GREEDY)
        assert d.step() == []  # its prefill step is back; its export is held
        assert d.producer.scheduler.find(rid).status is SequenceStatus.SENDING_KV
        assert d.abort(rid)
        assert d.consumer.num_free_kv_blocks < d.consumer.num_kv_blocks  # the write may still land
        assert rid in d.consumer.awaiting_kv  # (a step now would wait for the export: the driver is one thread)
        release.touch()
        outs = []
        while rid in d.consumer.awaiting_kv:
            outs += d.step()
        assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
        assert d.consumer.num_free_kv_blocks == d.consumer.num_kv_blocks
        assert d.producer.num_free_kv_blocks == d.producer.num_kv_blocks
