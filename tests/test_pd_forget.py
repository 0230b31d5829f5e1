"""A producer forgets a consumer instance (``ForgetConsumer``; a one-rank producer in
process, a pp2 one through its rank processes): an export in flight to it settles first
and is still reported to the owner, the pair closes on both ends (the consumer rank's
session ends), and pairing again serves the consumer as before. Before, a closed in-process sender's settled reports were
dropped with it: the request stayed in ``SENDING_KV``, its blocks held, for good."""

from __future__ import annotations

import pytest
from test_pd_async_export import BASE, _admit, _decode, _monolithic, _prompts
from transfer_kit import sessions_end

from pdflow import Deployment, compose
from pdflow.worker import faults

pytestmark = pytest.mark.slow


def _land(producer, limit: int = 200) -> list:
    """Step the producer until it has nothing left (bounded: a lost report never ends)."""
    firsts = []
    for _ in range(limit):
        if not producer.has_unfinished():
            return firsts
        firsts += producer.step()
    raise AssertionError(f"the producer still holds requests after {limit} steps: {firsts}")


@pytest.mark.parametrize("prefill", ["tp1", "pp2"])  # in process; one process per rank
def test_forgetting_the_consumer_settles_the_export_in_flight_closes_the_pair_and_pairs_again(
        prefill, tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv(faults.ENV, "export:prefill:0:hold")
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))
    prompts = _prompts()
    with Deployment(compose([*BASE, f"prefill={prefill}", "prefill.step_timeout_s=60"])) as d:
        producer = d.producer
        ranks = producer.instance.plan.ranks
        listener = d.consumer.instance.executor.stage.link.listener
        assert len(listener._sessions) == len(ranks)  # a pair per producer rank
        _admit(d, "a", prompts[0])
        producer.submit()
        assert producer.collect(wait=False) == []  # a's export is held: its report not taken
        release.touch()
        if len(ranks) == 1:
            link = producer.instance.executor.stage.link
            (peer,) = link.consumers[""].p2p.values()
        assert producer.forget("") == []  # the export settles before the pair closes
        if len(ranks) == 1:
            assert link.consumers == {} and peer.conn.sock.fileno() == -1
        assert sessions_end([listener])  # the consumer rank saw every pair go
        assert not producer.instance.forget("")  # nothing held any more
        firsts = _land(producer)  # the report of the export that settled at the close
        assert [o.request_id for o in firsts] == ["a"] and firsts[0].kv_error is None
        assert producer.num_free_kv_blocks == producer.num_kv_blocks
        tokens = _decode(d, firsts)
        producer.pair(d.consumer.instance.open_kv_link(), "")  # the consumer pairs again
        _admit(d, "b", prompts[1])
        tokens |= _decode(d, _land(producer))
        assert d.consumer.num_free_kv_blocks == d.consumer.num_kv_blocks
    assert [tokens["a"], tokens["b"]] == _monolithic(prompts)
