"""The OpenAI API as evaluation and benchmark clients use it (the shipped tiny model on
CPU, real uvicorn, the ``openai`` client): completions ``logprobs`` and ``echo`` (values
equal the engine's offline ones), chat ``logprobs``/``top_logprobs``, ``n`` > 1, ``seed``,
``stream_options.include_usage`` and ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from serve_fixtures import MODEL, PROMPTS

ASSET = Path(__file__).resolve().parents[1] / "pdflow" / "assets" / "tiny"


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def _hf_logprobs(ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``ids`` on the shipped checkpoint."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_equals_transformers(tiny_server, client):
    tok = tiny_server.host.backend.tokenizer
    ids = tok.encode(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp, n = r.choices[0].logprobs, len(ids)
    assert r.choices[0].text.startswith(tok.decode(ids))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_logprobs(ids)
    want = ref[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
    for pos in range(1, n + 1):  # position pos was scored by the logits at pos - 1
        top = lp.top_logprobs[pos]
        values, best = ref[pos - 1].topk(2)
        assert max(top.values()) == pytest.approx(values[0].item(), abs=1e-4)
        assert top[tok.decode([best[0].item()])] == pytest.approx(values[0].item(), abs=1e-4)
        assert lp.token_logprobs[pos] in top.values() and len(top) in (2, 3)  # top 2, and the chosen one
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # asking for prompt logprobs skips the cache


def test_generated_logprobs_streamed_equal_unstreamed(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=3)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    # the second request's prompt tail runs after a prefix hit: the same values up to fp32
    # rounding in another summation order
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-5)
    for chosen, top in zip(whole.token_logprobs, whole.top_logprobs, strict=True):
        assert chosen == max(top.values())  # greedy: the chosen token is the most likely
        assert len(top) == 3


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy
        assert bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_n_choices_with_a_seed_are_choices_of_seed_plus_i(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, n=3, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(**kw, seed=11 + i).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1  # the choices are not one sample thrice
    assert r.usage.completion_tokens == 24
    # Streamed: chunks name their choice; each choice's text is the unstreamed one.
    texts = {}
    for chunk in client.completions.create(**kw, n=3, seed=11, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == alone


def test_a_seed_repeats_its_tokens_whatever_else_is_in_the_batch(tiny_server, client):
    import concurrent.futures

    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw, seed=5).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.completions.create, **kw) for _ in range(3)]
        again = pool.submit(client.completions.create, **kw, seed=5)
        assert again.result().choices[0].text == first
        [o.result() for o in others]
    assert client.completions.create(**kw, seed=6).choices[0].text != first


def test_include_usage_ends_the_stream_with_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 3
    assert last.usage.total_tokens == last.usage.prompt_tokens + 3
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    plain = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)


def test_cached_tokens_are_the_engines_prefix_cache_hits(tiny_server, client):
    ids = tiny_server.host.backend.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1] + " " + PROMPTS[0])
    assert len(ids) > 2 * 16  # two full blocks of the fixture's 16 tokens at least
    kw = dict(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    cold = client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens
    warm = client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens
    assert cold < warm  # the first pass computed (and cached) what the second finds
    assert warm == (len(ids) - 1) // 16 * 16  # every full block but the last token's
    raw = httpx.post(tiny_server.url + "/v1/completions", json=kw).json()
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": warm}


def test_echo_alone_prepends_the_prompt_streamed_or_not(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=3, temperature=0)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    assert echoed.text == PROMPTS[1] + plain.text and echoed.logprobs is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, echo=True, stream=True))
    assert streamed == echoed.text
