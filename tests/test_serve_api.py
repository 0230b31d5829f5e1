"""The OpenAI-compatible API of one instance (the shipped tiny model on CPU) under real
uvicorn, driven by the official ``openai`` client and raw ``httpx``.

Oracle: the same LLM's offline greedy ``generate`` of each prompt, computed before the
server takes the engine over; served greedy text must equal it token for token.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_fixtures import CHAT, KEY, MAX_MODEL_LEN, MODEL, NUM_KV_BLOCKS, PROMPTS, N


def _metrics(url: str, headers=None) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics", headers=headers or {}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _count(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def served(tiny_server):
    return {"url": tiny_server.url, "keyed": tiny_server.keyed_url, "oracle": tiny_server.oracle}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0)


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(served["url"] + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_offline_greedy(served, client, prompt):
    want = served["oracle"][prompt]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), N)


def test_token_id_prompt_is_served_as_given(served, client):
    want = served["oracle"][PROMPTS[0]]
    r = client.completions.create(model=MODEL, prompt=want.prompt_token_ids, max_tokens=N, temperature=0)
    assert r.choices[0].text == want.text


def test_chat_uses_the_documented_fallback_template(served, client):
    want = served["oracle"]["chat"]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": role, "content": text} for role, text in CHAT], max_tokens=N,
        temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_completion_and_chat_concatenate_to_the_same_text(served, client):
    want = served["oracle"][PROMPTS[0]]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": r, "content": t} for r, t in CHAT], max_tokens=N, temperature=0,
        stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == served["oracle"]["chat"].text


def test_raw_sse_with_httpx(served):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", served["url"] + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == served["oracle"][PROMPTS[1]].text[:3]


def test_return_token_ids_gives_the_greedy_ids_streamed_or_not(served):
    """vLLM's ``return_token_ids``: the ids of the oracle's greedy answer and of the prompt,
    whole in a plain answer; streamed, each chunk's own ids (they concatenate to the same)
    and the prompt's in the first chunk only. Unasked, neither key appears."""
    want = served["oracle"][PROMPTS[1]]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0, "return_token_ids": True}
    choice = httpx.post(served["url"] + "/v1/completions", json=body).json()["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["prompt_token_ids"] == want.prompt_token_ids
    with httpx.stream("POST", served["url"] + "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [c["choices"][0] for c in chunks]
    assert [t for c in ids for t in c["token_ids"]] == want.token_ids
    assert ids[0]["prompt_token_ids"] == want.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in ids[1:])
    plain = httpx.post(served["url"] + "/v1/completions", json=body | {"return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_stop_string_ends_the_text_before_it(served, client):
    want = served["oracle"][PROMPTS[0]].text
    stop = want[2:4]  # appears in the greedy output, so generation must end there
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == want[: want.index(stop)]


BAD = [
    # (field class, request body changes, param, code)
    ("wrong type", {"max_tokens": "5"}, "max_tokens", "invalid_type"),
    ("bool for int", {"max_tokens": True}, "max_tokens", "invalid_type"),
    ("range low", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("range high", {"temperature": 2.5}, "temperature", "invalid_value"),
    ("top_p zero", {"top_p": 0.0}, "top_p", "invalid_value"),
    ("negative seed", {"seed": -1}, "seed", "invalid_value"),
    ("n above 16", {"n": 17}, "n", "invalid_value"),
    ("best_of other than n", {"n": 2, "best_of": 3}, "best_of", "invalid_value"),
    ("logprobs above 20", {"logprobs": 21}, "logprobs", "invalid_value"),
    ("stop type", {"stop": 7}, "stop", "invalid_value"),
    ("too many stops", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ("empty prompt list", {"prompt": []}, "prompt", "invalid_value"),
    ("batched prompts", {"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ("token id out of vocab", {"prompt": [1, 5000]}, "prompt", "invalid_value"),
    ("unknown field", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("missing model", {"model": None}, "model", "invalid_type"),
    ("unsupported option", {"suffix": "x"}, "suffix", "invalid_value"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value"),
    ("max_tokens past max_model_len", {"max_tokens": MAX_MODEL_LEN}, "max_tokens", "context_length_exceeded"),
    ("prompt past max_model_len", {"prompt": "x" * MAX_MODEL_LEN}, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize(("case", "change", "param", "code"), BAD, ids=[b[0] for b in BAD])
def test_invalid_completion_fields_get_openai_400(served, case, change, param, code):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2} | change
    r = httpx.post(served["url"] + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert err["message"]


CHAT_BAD = [
    ("no messages", {"messages": []}, "messages", "invalid_value"),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ("content type", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_value"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("tools", {"tools": [{"type": "function"}]}, "tools", "invalid_value"),
]


@pytest.mark.parametrize(("case", "change", "param", "code"), CHAT_BAD, ids=[b[0] for b in CHAT_BAD])
def test_invalid_chat_fields_get_openai_400(served, case, change, param, code):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | change
    r = httpx.post(served["url"] + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


def test_unknown_model_bad_json_and_unknown_route(served, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    r = httpx.post(served["url"] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(served["url"] + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_api_key_guards_every_route_but_health(served):
    url = served["keyed"]
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    right = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert right.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_metrics_agree_with_what_clients_saw(served, client):
    url = served["url"]
    before = _metrics(url)
    completion_tokens = 0
    for prompt, max_tokens in (("a", 2), ("bb", 3), ("ccc", 1)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        completion_tokens += r.usage.completion_tokens
    for _ in range(2):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    after = _metrics(url)

    def delta(name, **labels):
        return _count(after, name, **labels) - _count(before, name, **labels)

    assert delta("pdflow_requests_total", outcome="length") == 3
    assert delta("pdflow_requests_total", outcome="rejected") == 2
    assert delta("pdflow_generation_tokens_total") == completion_tokens == 6
    assert delta("pdflow_time_to_first_token_seconds_count") == 3
    # TTFT's parts: one observation each per answered request; the prefill part is a real
    # share of TTFT (a part taken from the wrong clock would be 0, or exceed TTFT)
    for part in ("pdflow_request_queue_time_seconds", "pdflow_request_prefill_time_seconds"):
        assert delta(f"{part}_count") == 3
    ttft = delta("pdflow_time_to_first_token_seconds_sum")
    assert 0 < delta("pdflow_request_prefill_time_seconds_sum") <= ttft
    assert 0 <= delta("pdflow_request_queue_time_seconds_sum") <= ttft
    assert delta("pdflow_inter_token_latency_seconds_count") == completion_tokens - 3
    total = _count(after, "pdflow_kv_blocks_total")
    assert total == NUM_KV_BLOCKS
    assert _count(after, "pdflow_kv_blocks_used") + _count(after, "pdflow_kv_blocks_free") == total


def test_client_disconnect_aborts_and_frees_blocks(served):
    url = served["url"]
    before = _metrics(url)
    body = {"model": MODEL, "prompt": "x" * 60, "max_tokens": 60, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _metrics(url)
        aborted = _count(now, "pdflow_requests_total", outcome="abort") - _count(
            before, "pdflow_requests_total", outcome="abort")
        if aborted == 1 and _count(now, "pdflow_kv_blocks_free") == NUM_KV_BLOCKS:
            break
        time.sleep(0.2)
    assert aborted == 1, "the disconnected stream was not aborted"
    assert _count(now, "pdflow_kv_blocks_free") == NUM_KV_BLOCKS, "the aborted request kept its KV blocks"
    assert _count(now, "pdflow_requests_running") == 0
    # The engine stopped it: it did not run on to its 60 tokens.
    generated = _count(now, "pdflow_generation_tokens_total") - _count(before, "pdflow_generation_tokens_total")
    assert 1 <= generated < 60
