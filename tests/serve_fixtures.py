"""The served tiny model the serve tests share (conftest's session fixture ``tiny_server``):
one LLM on CPU and its offline greedy answers (the oracle); the API as ``pdflow serve``
runs it (an engine-core process, an API front process before it), open and behind an API
key; and the LLM on an in-process engine loop (``host``) for tests that build apps on it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from pdflow import LLM, SamplingParams
from pdflow.serve.api import EngineHost
from pdflow.serve.backend import LLMBackend
from pdflow.serve.chat import fallback_prompt
from pdflow.serve.launch import serve_spec
from pdflow.spec import ParallelSpec
from pdflow.spec.load import compose_spec

MODEL = "tiny"
SPLIT = ["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=none", "model.max_model_len=128",
         "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16",
         "decode.num_kv_blocks=24", "decode.max_num_seqs=8", "tracking.enabled=false"]
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 24
PROMPTS = ("Question: Mira has 12 apples.", "The vault code of")
CHAT = (("system", "Be brief."), ("user", "What is 2 + 3?"))
N = 5
KEY = "sk-test-key"


@dataclass
class TinyServer:
    url: str
    keyed_url: str
    oracle: dict
    host: EngineHost


@contextlib.contextmanager
def tiny_server():
    parallel = ParallelSpec(block_size=16, kv_page_tokens=16, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8)
    llm = LLM("pdflow:assets/tiny", parallel, max_model_len=MAX_MODEL_LEN)
    with contextlib.ExitStack() as stack:
        stack.callback(llm.shutdown)
        greedy = SamplingParams(temperature=0, max_tokens=N)
        # One prompt at a time, as the tests send them (no batching differences).
        oracle = {p: llm.generate([p], greedy)[0] for p in PROMPTS}
        oracle["chat"] = llm.generate([llm.tokenizer.encode(fallback_prompt(list(CHAT)))], greedy)[0]
        host = EngineHost(LLMBackend(llm)).start()
        stack.callback(host.stop)
        plain = stack.enter_context(serve_spec(compose_spec(SPLIT), port=0))
        keyed = stack.enter_context(serve_spec(compose_spec([*SPLIT, f"serve.api_key={KEY}"]), port=0))
        yield TinyServer(url=plain.url, keyed_url=keyed.url, oracle=oracle, host=host)


def migrated_store(folder) -> None:
    """An empty MLflow sqlite store at ``folder/mlflow.db``. Creating one runs MLflow's
    schema migrations (tens of seconds on a slow disk), so tests copy this one."""
    from pdflow.tracking import store

    store.client(f"sqlite:///{folder}/mlflow.db").search_experiments()
