"""Faults of a P/D deployment seen through the router (HTTP, loopback): a producer stage
dying mid-transfer, a consumer rank killed after its KV handshake, a consumer rank gone
before the producer's first handshake with it. Each time the failing request ends within
its timeout with a 502 and an OpenAI body, the surviving instance serves the next request
alone, and its free KV blocks are back at their starting count.

The faults are real (``PDFLOW_TEST_FAULT`` makes a rank exit; ``SIGKILL`` a rank process);
the transfer engine is the real Mooncake over TCP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest

from pdflow import Deployment, compose
from pdflow.serve.api import EngineHost, create_app
from pdflow.serve.backend import LLMBackend
from pdflow.serve.router import create_router
from pdflow.serve.server import ServerThread
from pdflow.worker.faults import ENV as FAULT_ENV

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytestmark = pytest.mark.slow

MODEL = "tiny-pd"
STEP_TIMEOUT_S = TRANSFER_TIMEOUT_S = 20
SMALL = ["drafter=none", "model.max_model_len=96", "prefill.block_size=16", "decode.block_size=16",
         "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16", "prefill.num_kv_blocks=24",
         "decode.num_kv_blocks=24", f"prefill.step_timeout_s={STEP_TIMEOUT_S}",
         f"decode.step_timeout_s={STEP_TIMEOUT_S}", f"transfer.timeout_s={TRANSFER_TIMEOUT_S}"]


@contextlib.contextmanager
def served(overrides):
    """A deployment behind its API behind a router; yields (deployment, router URL)."""
    deployment = Deployment(compose([*SMALL, *overrides]))
    with contextlib.ExitStack() as stop:
        stop.callback(deployment.shutdown)
        backend = LLMBackend(deployment)
        host = EngineHost(backend).start()
        stop.callback(host.stop)
        instance = stop.enter_context(ServerThread(create_app(host, model_name=MODEL)))
        router = stop.enter_context(ServerThread(create_router([instance.url])))
        yield deployment, router.url


def _complete(url: str, prompt: list[int]) -> tuple[httpx.Response, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, timeout=STEP_TIMEOUT_S * 4)
    return r, time.monotonic() - start


def _failed_in_time(r: httpx.Response, took: float, *mentions: str) -> None:
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "backend_error"
    assert any(m in err["message"] for m in mentions), err["message"]
    assert took < STEP_TIMEOUT_S + TRANSFER_TIMEOUT_S, f"the failure took {took:.1f} s to answer"


def _survivor_serves(deployment: Deployment, url: str, survivor: str) -> None:
    r, _ = _complete(url, [7, 8, 9, 10, 11])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert httpx.get(url + "/health").status_code == 200
    engine = deployment.producer if survivor == "prefill" else deployment.consumer
    deadline = time.monotonic() + 10
    while engine.num_free_kv_blocks != engine.num_kv_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_free_kv_blocks == engine.num_kv_blocks, "the survivor leaked blocks"
    assert list(deployment.free_kv_blocks()) == [survivor]


def test_a_producer_stage_dying_mid_transfer_is_a_502_and_the_consumer_serves_on(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "export:prefill:1:die")  # inherited by the producer's rank processes
    with served(["prefill=pp2", "decode=tp1"]) as (deployment, url):
        monkeypatch.delenv(FAULT_ENV)
        r, took = _complete(url, list(range(4, 44)))
        _failed_in_time(r, took, "prefill instance was lost")
        assert deployment.lost["prefill"] is not None and deployment.lost["decode"] is None
        _survivor_serves(deployment, url, "decode")


@pytest.mark.parametrize("served_before", [1, 0], ids=["after-handshake", "handshake-peer-gone"])
def test_a_consumer_rank_killed_is_a_502_and_the_producer_serves_on(served_before):
    with served(["prefill=tp1", "decode=tp2"]) as (deployment, url):
        for _ in range(served_before):  # the producer's engine has a session with every consumer rank
            r, _ = _complete(url, [4, 5, 6])
            assert r.status_code == 200, r.text
        os.kill(deployment.consumer.instance.executor.pids[1], signal.SIGKILL)
        r, took = _complete(url, list(range(4, 44)))
        _failed_in_time(r, took, "KV transfer failed", "decode instance was lost")
        assert deployment.lost["decode"] is not None
        _survivor_serves(deployment, url, "prefill")


def test_a_deployment_with_no_instance_left_refuses_at_once():
    """The only instance lost: the next request is refused at once with a 503 naming the
    loss (it once raised an AttributeError inside admission, past the requests the dying
    loop fails, and hung to the client's timeout)."""
    with served(["mode=monolithic", "decode=tp2"]) as (deployment, url):
        os.kill(deployment.consumer.instance.executor.pids[1], signal.SIGKILL)
        r, took = _complete(url, list(range(4, 44)))
        _failed_in_time(r, took, "decode instance was lost")
        r, took = _complete(url, [7, 8, 9])  # the instance's 503 passes through the router
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_error" and "every instance of this deployment was lost" in err["message"], err
        assert took < STEP_TIMEOUT_S, f"the refusal took {took:.1f} s"
