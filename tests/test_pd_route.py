"""A request's P/D route (``pd_wire.PDRoute``) is a typed field its ticket carries to
``backend.add``: a decode backend given one has the prompt prefilled at the producer it
names (blocks allocated here, the exchange posted there), one without serves it whole;
each P/D backend refuses the other side's route, and the backends that serve every
request whole (``LLMBackend``, the engine core's client) refuse any route."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from pdflow import LLM
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.sequence import KVTarget
from pdflow.serve.backend import LLMBackend
from pdflow.serve.engine_loop import EngineLoop
from pdflow.serve.pd_wire import PAIR_PATH, PREFILL_PATH, PDRoute, PrefillAnswer, RemotePrefill
from pdflow.spec import ParallelSpec

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")

PD = ["mode=pd", "prefill=tp1", "decode=tp1", "drafter=none", "tracking.enabled=false", "model.max_model_len=128",
      "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"]
GREEDY = SamplingParams(temperature=0, max_tokens=3)
SETTLE_S = 60  # a bound on waiting, so a broken exchange fails the test instead of hanging it


class StubProducer:
    """A producer's two routes on loopback: it records what consumers post and answers
    every prefill with an error (no KV lands), so the consumer must free the blocks."""

    def __init__(self):
        posts = self.posts = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                posts.append((self.path, body))
                answer = (msgspec.json.encode(PrefillAnswer(error="stub producer: no KV")) if self.path == PREFILL_PATH
                          else json.dumps({"paired": "x"}).encode())
                self.send_response(200)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def consumer():
    from pdflow.engine.instance import Instance
    from pdflow.engine.llm_engine import LLMEngine
    from pdflow.graph import CONSUMER
    from pdflow.serve.pd_decode import DecodeBackend
    from pdflow.spec.load import compose_spec

    engine = LLMEngine(Instance(compose_spec(PD), CONSUMER))
    with contextlib.ExitStack() as stack:
        stack.callback(engine.shutdown)
        backend = DecodeBackend(engine, fingerprint="f", api_key=None, timeout_s=30.0)
        stack.callback(backend.shutdown)
        producer = StubProducer()
        stack.callback(producer.stop)
        yield backend, producer


def _until_finished(backend, rid: str):
    outputs, deadline = [], time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        outputs += [o for o in backend.step() if o.request_id == rid]
        if outputs and outputs[-1].finished:
            return outputs
    raise AssertionError(f"{rid} did not finish within {SETTLE_S} s: {outputs}")


def test_a_decode_backend_without_a_route_serves_the_request_whole(consumer):
    backend, producer = consumer
    before = (backend.reuse.local_prefills, backend.reuse.remote_prefills, len(producer.posts))
    rid = backend.add(list(range(1, 40)), GREEDY)
    outputs = _until_finished(backend, rid)
    assert [o.error for o in outputs] == [None] * 3 and outputs[-1].finish_reason == "length"
    after = (backend.reuse.local_prefills, backend.reuse.remote_prefills, len(producer.posts))
    assert after == (before[0] + 1, before[1], before[2])  # prefilled here, nothing posted


def test_a_decode_backend_given_a_route_prefills_at_its_producer_and_frees_on_its_error(consumer):
    backend, producer = consumer
    prompt, free = list(range(100, 150)), backend.num_free_kv_blocks
    before = (backend.reuse.local_prefills, backend.reuse.remote_prefills)
    rid = backend.add(prompt, GREEDY, route=PDRoute(prefill_at=producer.url))
    assert backend.num_free_kv_blocks < free  # the prompt's blocks, allocated here for the producer
    outputs = _until_finished(backend, rid)
    assert len(outputs) == 1 and "stub producer: no KV" in outputs[0].error
    assert (backend.reuse.local_prefills, backend.reuse.remote_prefills) == (before[0], before[1] + 1)
    assert backend.num_free_kv_blocks == free  # the failed exchange freed them
    paths = [path for path, _ in producer.posts]
    assert paths[-2:] == [PAIR_PATH, PREFILL_PATH]
    job = msgspec.json.decode(producer.posts[-1][1], type=RemotePrefill)
    assert job.prompt_token_ids == prompt and job.request_id == rid and job.target.consumer == backend.consumer_id
    assert len(job.target.blocks) == -(-len(prompt) // backend.block_size)


def test_a_decode_backends_wake_ends_its_wait_and_loses_no_answer(consumer):
    """``wake`` (a command for the loop) puts a marker among the exchanges' answers: a
    ``step`` waiting for one returns, and an answer queued beside the marker still settles."""
    backend, producer = consumer
    backend.wake()
    backend.wake()
    assert backend.step() == []  # woken twice, nothing to settle
    free = backend.num_free_kv_blocks
    rid = backend.add(list(range(200, 240)), GREEDY, route=PDRoute(prefill_at=producer.url))
    backend.wake()
    outputs = _until_finished(backend, rid)
    assert len(outputs) == 1 and "stub producer: no KV" in outputs[0].error
    assert backend.num_free_kv_blocks == free and backend.results.empty()


def test_each_pd_backend_refuses_the_other_sides_route(consumer):
    from pdflow.serve.pd_prefill import PrefillBackend

    backend, _ = consumer
    job = RemotePrefill(request_id="r", prompt_token_ids=[1, 2], sampling=GREEDY,
                        target=KVTarget(blocks=(0,), nonce=1, consumer="c"))
    with pytest.raises(ValueError, match="takes no remote prefill"):
        backend.add([1, 2], GREEDY, route=PDRoute(remote=job))
    with pytest.raises(ValueError, match="sends no prompt to another producer"):
        PrefillBackend(engine=None).add([1, 2], GREEDY, route=PDRoute(prefill_at="http://127.0.0.1:1"))
    with pytest.raises(ValueError, match="exactly one"):
        PDRoute()
    with pytest.raises(ValueError, match="exactly one"):
        PDRoute(prefill_at="http://127.0.0.1:1", remote=job)


def test_a_monolithic_backend_refuses_a_route_and_serves_on():
    llm = LLM("pdflow:assets/tiny", ParallelSpec(block_size=16, kv_page_tokens=16, num_kv_blocks=16, max_num_seqs=4),
              max_model_len=64)
    loop = EngineLoop(LLMBackend(llm)).start()

    async def last_event(route):
        _, events = loop.open_stream([1, 2, 3], GREEDY, route=route)
        event = await events.get()
        while not event.done:
            event = await events.get()
        return event

    try:
        refused = asyncio.run(last_event(PDRoute(prefill_at="http://127.0.0.1:1")))
        served = asyncio.run(last_event(None))
    finally:
        loop.stop()
        llm.shutdown()
    assert refused.error_status == 400 and "cannot take a P/D route" in refused.error and refused.error_param is None
    assert served.error is None and served.finish_reason == "length"


def test_the_engine_cores_client_refuses_a_route_without_sending_it():
    from pdflow.serve.core_wire import Facts
    from pdflow.serve.engine_client import CoreFacts, EngineClient

    async def main():
        client = EngineClient("tcp://127.0.0.1:1", front=0, core_pid=0)  # nothing listens: nothing may be sent
        client.facts = CoreFacts(Facts(max_model_len=64, vocab_size=100, block_size=16, num_kv_blocks=8,
                                       tokenizer_folder=None))
        try:
            _, events = client.open_stream([1, 2], GREEDY, route=PDRoute(prefill_at="http://127.0.0.1:1"))
            return await asyncio.wait_for(events.get(), SETTLE_S), dict(client.streams)
        finally:
            client.close()

    event, streams = asyncio.run(main())
    assert event.error_status == 400 and "cannot take a P/D route" in event.error and streams == {}
    assert event.error_param is None
