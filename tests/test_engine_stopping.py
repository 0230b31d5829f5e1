"""When a request ends (stop ids, stop strings, EOS, max_tokens) and seeded sampling
through the whole engine."""

from __future__ import annotations

import pytest

from pdflow import LLM, SamplingParams
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec

PROMPT = "w10 w11 w12 w13 w14"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = write_random_checkpoint(
        tmp_path_factory.mktemp("qwen3"), family="qwen3", init_std=0.3, seed=2
    )
    spec = ParallelSpec(block_size=16, kv_page_tokens=8, num_kv_blocks=32)
    return LLM(str(folder), spec, dtype="float32")


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 20, "ignore_eos": True, **kw})


def first_new_token_position(tokens: list[int]) -> int:
    """An index past the start whose token did not occur before it."""
    return next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_end_the_request_on_that_token(llm):
    full = llm.generate([PROMPT], greedy())[0]
    i = first_new_token_position(full.token_ids)
    out = llm.generate([PROMPT], greedy(stop_token_ids=[full.token_ids[i]]))[0]
    assert out.token_ids == full.token_ids[: i + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm, monkeypatch):
    full = llm.generate([PROMPT], greedy())[0]
    i = first_new_token_position(full.token_ids)
    monkeypatch.setattr(llm.engine, "eos_token_ids", {full.token_ids[i]})
    stopped = llm.generate([PROMPT], greedy(ignore_eos=False))[0]
    assert stopped.token_ids == full.token_ids[: i + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([PROMPT], greedy(ignore_eos=True))[0]
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"


def test_stop_strings_cut_the_text_before_the_match(llm):
    full = llm.generate([PROMPT], greedy())[0]
    i = first_new_token_position(full.token_ids)
    word = llm.tokenizer.decode([full.token_ids[i]])
    out = llm.generate([PROMPT], greedy(stop=[word]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: i + 1]
    assert out.text == full.text[: full.text.index(word)]
    streamed = "".join(o.text for o in llm.stream([PROMPT], greedy(stop=[word])))
    assert streamed == out.text


def test_max_tokens_and_streamed_text(llm):
    out = llm.generate([PROMPT], greedy(max_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert "".join(o.text for o in llm.stream([PROMPT], greedy(max_tokens=7))) == out.text


def test_seeded_sampling_reproduces_through_the_engine(llm):
    def sample(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return llm.generate([PROMPT] * 3, params)

    a, b = sample(1), sample(1)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # Same seed per request: the three identical requests draw identical tokens.
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids
    assert sample(2)[0].token_ids != a[0].token_ids
    assert llm.num_free_kv_blocks == llm.num_kv_blocks
