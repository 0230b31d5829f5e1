"""The split server (issue 30): the engine core in a process of its own, API fronts in
others, over ZMQ. Greedy tokens served equal offline tokens (fp32, tiny model, the front
detokenizing), a killed front loses no engine state, a killed core turns into 503s with
an OpenAI error body and a failed server (``pdflow serve`` exits 3), never a hang."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import proc_helpers
import pytest

from pdflow import Deployment, SamplingParams, compose
from pdflow.serve.backend import DraftStats
from pdflow.serve.core_wire import Delta, Steps, encode, front_decoder, to_delta, to_event
from pdflow.serve.serving_core import StreamEvent
from pdflow.serve.text_stream import TextStream

OVERRIDES = ["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=none", "model.max_model_len=128",
             "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16",
             "decode.kv_page_tokens=16", "decode.num_kv_blocks=48", "tracking.enabled=false"]
PROMPTS = ("Question: Mira has 12 apples.", "The vault code of", "Once upon a time", "2 + 3 =")
N = 12


@pytest.fixture(scope="module")
def oracle():
    """Offline greedy answers of the same deployment in this process."""
    with Deployment(compose(OVERRIDES)) as deployment:
        greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
        outs = {p: deployment.generate([p], greedy)[0] for p in PROMPTS}
        stop_at = outs[PROMPTS[0]].text[3:5]  # a stop string the greedy answer runs into
        stopped = deployment.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=N, stop=[stop_at]))[0]
    return outs, stop_at, stopped


# Children of this process that belong to other servers (started before this module's).
_OTHERS: set[int] = set()


@pytest.fixture(scope="module")
def served():
    from pdflow.serve.launch import serve_spec

    _OTHERS.update(_server_children(os.getpid()))  # other servers' children (a session fixture's)
    with serve_spec(compose([*OVERRIDES, "serve.api_servers=2"]), port=0) as s:
        yield s


def _complete(url: str, prompt: str, *, stream: bool, **extra) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": stream} | extra
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return text


def _free_blocks(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    free = float(re.search(r"^pdflow_kv_blocks_free (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^pdflow_kv_blocks_total (\S+)$", text, re.M).group(1))
    return free, total


def test_greedy_served_through_the_fronts_equals_offline(served, oracle):
    outs, stop_at, stopped = oracle
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: _complete(served.url, job[0], stream=job[1]), jobs))
    for (prompt, stream), text in zip(jobs, texts, strict=True):
        assert text == outs[prompt].text, (prompt, stream)
    # The front cuts at a stop string where the engine stopped (text is made in the front).
    for stream in (False, True):
        assert _complete(served.url, PROMPTS[0], stream=stream, stop=[stop_at], ignore_eos=False) == stopped.text


def test_metrics_are_the_cores_whichever_front_answers(served):
    before = httpx.get(f"{served.url}/metrics", timeout=30).text
    count = float(re.search(r'^pdflow_requests_total\{outcome="length"\} (\S+)$', before, re.M).group(1))
    for _ in range(4):  # new connections: both fronts take some
        _complete(served.url, PROMPTS[1], stream=False)
    after = httpx.get(f"{served.url}/metrics", timeout=30).text
    assert float(re.search(r'^pdflow_requests_total\{outcome="length"\} (\S+)$', after, re.M).group(1)) == count + 4


def test_a_killed_front_loses_no_engine_state(served, oracle):
    supervisor_pids = _server_children(os.getpid())
    fronts = [p for p in supervisor_pids if "front_process" in _cmdline(p)]
    core = [p for p in supervisor_pids if "core_process" in _cmdline(p)]
    assert len(fronts) == 2 and len(core) == 1
    os.kill(fronts[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while len([p for p in _server_children(os.getpid()) if "front_process" in _cmdline(p)]) < 2:
        assert time.monotonic() < deadline, "the killed front was not started again"
        time.sleep(0.1)
    assert [p for p in _server_children(os.getpid()) if "core_process" in _cmdline(p)] == core
    for stream in (False, True):
        assert _complete(served.url, PROMPTS[2], stream=stream) == oracle[0][PROMPTS[2]].text
    free, total = _free_blocks(served.url)
    assert free == total


def test_the_wire_carries_every_event_field_by_name():
    """A StreamEvent field missing from the wire's Delta would be dropped silently."""
    from dataclasses import fields

    event_fields = {f.name for f in fields(StreamEvent)} - {"text"}
    assert event_fields == set(Delta.__struct_fields__) - {"rid"}
    event = StreamEvent(token_ids=[3, 4], finish_reason="length", error=None, retry_after_s=2)
    (delta,) = front_decoder.decode(encode(Steps(deltas=[to_delta("r", event)]))).deltas
    assert to_event(delta, "xy") == StreamEvent(token_ids=[3, 4], text="xy", finish_reason="length", retry_after_s=2)
    # Every field away from its default, so one that to_delta or to_event skips shows.
    full = StreamEvent(token_ids=[1], text="t", finish_reason="stop", draft=DraftStats(drafted=3, accepted=2,
                       verify_steps=1), error="e", error_status=502, error_param="prompt", retry_after_s=4, logprobs=[-0.5],
                       top_logprobs=[[(1, -0.5)]], prompt_logprobs=[-1.0], prompt_top_logprobs=[[(2, -1.0)]],
                       num_cached_tokens=16)
    defaults = StreamEvent()
    assert all(getattr(full, f.name) != getattr(defaults, f.name) for f in fields(StreamEvent))
    (delta,) = front_decoder.decode(encode(Steps(deltas=[to_delta("r", full)]))).deltas
    back = to_event(delta, "t")
    back.top_logprobs = [[tuple(p) for p in row] for row in back.top_logprobs]  # msgpack: tuples as lists
    back.prompt_top_logprobs = [[tuple(p) for p in row] for row in back.prompt_top_logprobs]
    assert back == full


def test_front_text_holds_back_what_may_become_a_stop_string():
    class Chars:  # one character per id
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    stream = TextStream(Chars(), ["cd"])
    got = [stream.push([ord(c)], finished=False) for c in "abc"] + [stream.push([ord("d")], finished=True)]
    assert got == ["", "a", "b", ""]  # "c" is held back (it may begin "cd"), then cut with it


def test_a_killed_core_is_503_then_the_server_exits_nonzero(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", *OVERRIDES, "serve.port=0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _url_of(proc)
        (core,) = [p for p in _server_children(proc.pid) if "core_process" in _cmdline(p)]
        children = _server_children(proc.pid)
        with httpx.stream("POST", f"{url}/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 100, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(core, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"error"' in rest[-1] and "engine core" in rest[-1], rest[-3:]
        after = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable", after.text
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, out
    assert "engine core process exited" in out
    assert not [p for p in children if Path(f"/proc/{p}").exists() and _cmdline(p)], "children left running"


def test_a_front_that_cannot_start_fails_the_server_instead_of_hanging():
    """A front that dies as it starts (here: its module does not exist, as a missing
    dependency of the API would) fails ``wait_ready`` by name, not after its timeout with the
    socket queueing connections nobody answers; nothing is left running."""
    from pdflow.serve.front_process import FrontOptions
    from pdflow.serve.supervisor import FRONT_CRASH_LIMIT, Supervisor

    class BrokenFronts(Supervisor):
        FRONT_TARGET = "pdflow.serve.no_such_front:front_main"

    spec = compose([*OVERRIDES, "serve.api_servers=2"])
    supervisor = BrokenFronts(spec, host="127.0.0.1", port=0, options=FrontOptions(model_name="tiny", api_key=None,
                                                                                     request_timeout_s=None, max_body_bytes=1 << 20))
    children: list[int] = []
    try:
        supervisor.start()
        children = [supervisor.core.pid]
        with pytest.raises(RuntimeError, match=f"API front process . exited {FRONT_CRASH_LIMIT} times before it served"):
            supervisor.wait_ready(timeout=600)
    finally:
        supervisor.stop()
    assert not [p for p in children if Path(f"/proc/{p}").exists() and _cmdline(p)], "children left running"


def test_a_front_that_starts_slowly_is_waited_for_not_restarted(monkeypatch):
    """A front is failed for exiting before it serves, never for taking its time: one that
    sleeps before its imports (``slow_front``) serves as the first and only process of its
    slot, with no failed start counted. A start window shorter than its sleep would kill
    and restart it (a new pid) or fail the server."""
    from slow_front import SLOW_START_S

    from pdflow.serve.front_process import FrontOptions
    from pdflow.serve.supervisor import Supervisor

    class SlowFronts(Supervisor):
        FRONT_TARGET = "slow_front:front_main"

    tests_dir = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    spec = compose([*OVERRIDES, "serve.api_servers=1"])
    supervisor = SlowFronts(spec, host="127.0.0.1", port=0, options=FrontOptions(model_name="tiny", api_key=None,
                                                                                 request_timeout_s=None, max_body_bytes=1 << 20))
    try:
        supervisor.start()
        first = supervisor.fronts[0].pid
        started = time.monotonic()
        supervisor.wait_ready(timeout=600)
        assert time.monotonic() - started >= SLOW_START_S  # the slow front is what answered
        reply = httpx.post(f"{supervisor.url}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert supervisor.fronts[0].pid == first and supervisor.fronts[0].is_alive()
        assert supervisor._failed_starts == [0] and supervisor.failure is None
    finally:
        supervisor.stop()


def _url_of(proc) -> str:
    deadline, seen = time.monotonic() + 300, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        if found:
            return found.group(1)
    raise AssertionError("no URL from pdflow serve:\n" + "".join(seen[-40:]))


def _server_children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (the supervisor's thread restarts fronts), but
    those of servers this module did not start."""
    return [c for c in proc_helpers.children(pid) if c not in _OTHERS]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""
