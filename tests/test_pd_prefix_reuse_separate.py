"""Decode-side prefix reuse with separately started instances (prefill, decode, router
with router.policy=prefix): a conversation's second turn moves only its uncached
blocks over the wire (``RemotePrefill.target.first_block``), its third, short uncached part is
prefilled on the decode instance (counted), ``usage.prompt_tokens_details.cached_tokens``
is the decode side's, and every turn decodes ``Deployment``'s greedy tokens."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_pd_separate import SPEC, _start, _stop, _url_of

from pdflow import Deployment, SamplingParams, compose

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

MAX_TOKENS = 6


def _turns() -> list[list[int]]:
    """70 tokens (4 full blocks of 16); + 30 (36 uncached on the decode side); + 5 (9)."""
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(4, 120, (70,), generator=gen).tolist()
    second = first + torch.randint(4, 120, (30,), generator=gen).tolist()
    return [first, second, second + torch.randint(4, 120, (5,), generator=gen).tolist()]


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def instances():
    procs = {}
    try:
        procs["decode"] = _start("decode", "router.local_prefill_tokens=20")
        procs["prefill"] = _start("prefill")
        urls = {name: _url_of(proc) for name, proc in procs.items()}
        procs["router"] = _start("router", f"serve.prefill=[{urls['prefill']}]", f"serve.decode=[{urls['decode']}]",
                                 "router.policy=prefix")
        urls["router"] = _url_of(procs["router"])
        yield urls
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            _stop(proc)


def test_turns_move_only_uncached_blocks_and_decode_the_deployments_tokens(instances):
    turns = _turns()
    with Deployment(compose([*SPEC, "router.prefix_reuse=false"])) as d:
        want = [o.text for o in d.generate(turns, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                 ignore_eos=True))]
    got, cached = [], []
    for ids in turns:  # in order: each turn lands before the next is sent
        r = httpx.post(instances["router"] + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        got.append(body["choices"][0]["text"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert got == want
    assert cached == [0, 64, 96]  # the decode instance's own hits (turn three: local, its cache)
    decode, prefill = _metrics(instances["decode"]), _metrics(instances["prefill"])
    assert decode["pdflow_prefills_total{remote}"] == 2 and decode["pdflow_prefills_total{local}"] == 1
    assert decode["pdflow_kv_reused_tokens_total"] == 64
    assert decode["pdflow_kv_received_blocks_total"] == 5 + 3  # turn two: 7 blocks, 4 cached
    assert prefill["pdflow_kv_sent_blocks_total"] == 5 + 3
    assert prefill["pdflow_kv_sent_bytes_total"] == decode["pdflow_kv_received_bytes_total"] > 0
    assert decode["pdflow_prefix_cache_hit_tokens_total{decode}"] == 64 + 96  # turn two's match, turn three's
    assert prefill["pdflow_prefix_cache_hit_tokens_total{prefill}"] == 64  # its own compute reuse, turn two
