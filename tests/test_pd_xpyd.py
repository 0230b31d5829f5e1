"""xPyD: two prefill and two decode instances, each its own ``pdflow serve`` process,
behind one router. Interleaved requests over every (prefill, decode) pair serve
``Deployment``'s greedy tokens, every prefill instance really prefills, and each pair
pairs exactly once (``pdflow_kv_pairings_total{peer=}`` on both ends): a prefill instance
serves two decode instances from one peer table, with no drain and no re-pairing."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_pd_separate import MAX_TOKENS, PROMPTS, SPEC, _complete, _start, _stop, _url_of

from pdflow import Deployment, SamplingParams, compose

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

# Two rounds over the four pairs (the router turns the prefill instances one place further
# each round of the decode instances), sent four at a time so they interleave.
ROUNDS = [*PROMPTS, "The capital of France is", *PROMPTS, "The capital of France is"]


@pytest.fixture(scope="module")
def two_by_two():
    procs = {}
    try:
        for name in ("d0", "d1", "p0", "p1"):  # all start at once
            procs[name] = _start("decode" if name[0] == "d" else "prefill")
        urls = {name: _url_of(proc) for name, proc in procs.items()}
        procs["router"] = _start("router", f"serve.prefill=[{urls['p0']},{urls['p1']}]",
                                 f"serve.decode=[{urls['d0']},{urls['d1']}]")
        urls["router"] = _url_of(procs["router"])
        yield urls
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            _stop(proc)


def _pairings(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["peer"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "pdflow_kv_pairings" for s in f.samples if s.name == "pdflow_kv_pairings_total"}


def test_two_prefill_two_decode_serve_the_deployments_tokens_and_pair_once_each(two_by_two):
    urls = two_by_two
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Deployment(compose(SPEC)) as d:
        expected = [o.text for o in d.generate([d.tokenizer.encode(p) for p in ROUNDS], greedy)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ip: _complete(urls["router"], ip[1], stream=ip[0] % 3 == 1),
                            enumerate(ROUNDS)))
    assert got == expected
    consumer_ids = {httpx.get(urls[d] + "/pdflow/instance", timeout=10).json()["consumer_id"] for d in ("d0", "d1")}
    for p in ("p0", "p1"):
        card = httpx.get(urls[p] + "/pdflow/instance", timeout=10).json()
        assert card["prefills"] == len(ROUNDS) // 2  # each prefill instance served its half
        assert _pairings(urls[p]) == dict.fromkeys(consumer_ids, 1.0)  # both consumers, once each
    for d in ("d0", "d1"):
        assert _pairings(urls[d]) == {urls["p0"]: 1.0, urls["p1"]: 1.0}
