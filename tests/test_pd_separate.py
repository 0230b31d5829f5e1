"""P/D with instances started as separate commands: ``pdflow serve role=decode``,
``role=prefill`` and ``role=router`` as three processes on loopback serve the same greedy
tokens as ``pdflow.Deployment`` of the same spec, the producer really prefills every
request, and instances of another run graph or the wrong role are refused by name."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from pdflow import Deployment, SamplingParams, compose
from pdflow.serve.pd_instance import check_instances
from pdflow.serve.pd_wire import PAIR_PATH, InstanceCard, PairRequest, RunGraphMismatch, check_same_graph

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

SPEC = ["prefill=tp1", "decode=tp1", "drafter=none", "tracking=off", "prefill.block_size=16",
        "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"]
PROMPTS = ["Question: Mira has 12 apples and gives 5 away. How many are left?", "The vault code of",
           "Once upon a time in a small village by the sea, there lived an old fisherman who"]
MAX_TOKENS = 6
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "WARNING"}
URL = re.compile(r" at (http://127\.0\.0\.1:\d+)/v1")


def _start(role: str, *extra: str, spec: list[str] = SPEC) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", f"role={role}", "serve.port=0",
                             *spec, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV, start_new_session=True)


def _url_of(proc: subprocess.Popen, timeout: float = 240) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        found = URL.search(line)
        if found:
            return found.group(1)
    raise AssertionError("no URL from pdflow serve:\n" + "".join(seen[-40:]))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    proc.stdout.close()


@contextlib.contextmanager
def _instances(spec: list[str]):
    procs = []
    try:
        procs.append(_start("decode", spec=spec))
        procs.append(_start("prefill", spec=spec))
        decode, prefill = _url_of(procs[0]), _url_of(procs[1])
        procs.append(_start("router", f"serve.prefill=[{prefill}]", f"serve.decode=[{decode}]", spec=spec))
        router = _url_of(procs[2])
        yield {"router": router, "prefill": prefill, "decode": decode}
    finally:
        for proc in procs:  # all at once, then wait for each
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            _stop(proc)


@pytest.fixture(scope="module")
def separate():
    with _instances(SPEC) as urls:
        yield urls


def _complete(url: str, prompt: str, *, stream: bool = False) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += msgspec.json.decode(line[6:])["choices"][0]["text"]
    return text


def test_separate_instances_serve_the_deployments_greedy_tokens(separate):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Deployment(compose(SPEC)) as d:
        expected = [o.text for o in d.generate([d.tokenizer.encode(p) for p in PROMPTS], greedy)]
    got = [_complete(separate["router"], p, stream=i == 1) for i, p in enumerate(PROMPTS)]
    assert got == expected
    card = httpx.get(separate["prefill"] + "/pdflow/instance", timeout=10).json()
    assert card["role"] == "prefill" and card["prefills"] == len(PROMPTS)  # the producer did prefill


def test_a_prefill_instance_of_two_rank_processes_serves_the_deployments_greedy_tokens():
    """PP2 prefill: the ranks are processes of their own, and the instance's loop learns
    that an export settled from the watch on their pipes (``Executor.on_settled``)."""
    spec = ["prefill=pp2", *SPEC[1:]]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Deployment(compose(spec)) as d:
        expected = [o.text for o in d.generate([d.tokenizer.encode(p) for p in PROMPTS], greedy)]
    with _instances(spec) as urls:
        got = [_complete(urls["router"], p, stream=i == 1) for i, p in enumerate(PROMPTS)]
        card = httpx.get(urls["prefill"] + "/pdflow/instance", timeout=10).json()
    assert got == expected
    assert card["prefills"] == len(PROMPTS)


def test_echo_logprobs_through_separate_instances_equal_the_deployments(separate):
    """The prefill instance scores the prompt; the scores travel in its answer."""
    ask = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    with Deployment(compose(SPEC)) as d:
        ids = d.tokenizer.encode(PROMPTS[1])
        want = d.generate([ids], ask)[0]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 2}
    r = httpx.post(separate["router"] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want.prompt_logprobs + want.logprobs, abs=1e-5)
    assert [max(t.values()) for t in lp["top_logprobs"][len(ids):]] == pytest.approx(
        [top[0][1] for top in want.top_logprobs], abs=1e-5)


def test_instances_of_another_graph_or_role_are_refused(separate):
    prefill, decode = separate["prefill"], separate["decode"]
    with pytest.raises(RunGraphMismatch, match="given as a prefill instance but serves serve.role=decode"):
        check_instances([decode], [decode], api_key=None, timeout=10)
    card = InstanceCard(role="decode", model="tiny", fingerprint="0" * 16, max_model_len=64)
    real = msgspec.convert(httpx.get(prefill + "/pdflow/instance", timeout=10).json(), InstanceCard)
    with pytest.raises(RunGraphMismatch, match="different run graphs"):
        check_same_graph({prefill: real, decode: card})
    foreign = PairRequest(consumer_id="x", fingerprint="0" * 16, endpoints=[])
    r = httpx.post(prefill + PAIR_PATH, content=msgspec.json.encode(foreign), timeout=10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "run_graph_mismatch"
    assert "RunGraphMismatch" in r.json()["error"]["message"]


def test_a_graph_of_other_overrides_has_another_fingerprint():
    from pdflow.serve.pd_wire import fingerprint

    assert fingerprint(compose(SPEC)) == fingerprint(compose([*SPEC, "serve.port=1234"]))
    assert fingerprint(compose(SPEC)) != fingerprint(compose([*SPEC, "prefill.kv_page_tokens=8",
                                                                 "decode.kv_page_tokens=8"]))
