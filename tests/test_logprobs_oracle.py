"""Logprobs equal transformers' (fp32, CPU): the prompt's (echo + logprobs, scored where
the prompt is prefilled, chunk by chunk), each generated token's top k, one process and
P/D (a PP prefill, a TP decode: the prefill scores the prompt and the scores travel with
the first token). A prompt row scored one position off is caught."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pdflow import LLM, Deployment, SamplingParams, compose
from pdflow.engine import step_input
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec

TOP = 3
ASK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
# 70 tokens over a 32-token step budget: the prompt is prefilled (and scored) in three chunks.
LENS = (5, 70)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lp")
    return write_random_checkpoint(folder, family="llama", layers=4, hidden=128, heads=8, kv_heads=4,
                                   head_dim=32, intermediate=256, vocab=256, seed=3, init_std=0.3)


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(4, 256, (n,), generator=gen).tolist() for n in LENS]


def _hf_logprobs(folder, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``ids`` [len, V]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(folder, out, prompt, atol=1e-4):
    full = prompt + out.token_ids
    ref = _hf_logprobs(folder, full)
    n = len(prompt)
    want = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
    assert len(out.prompt_logprobs) == n - 1
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=atol, rtol=1e-4)
    for pos, top in enumerate(out.prompt_top_logprobs):
        values, ids = ref[pos].topk(TOP)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=atol, rtol=1e-4)
    for j, top in enumerate(out.top_logprobs):  # generated token j was scored at n - 1 + j
        values, ids = ref[n - 1 + j].topk(TOP)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=atol, rtol=1e-4)
        assert out.token_ids[j] == ids[0].item()  # greedy: the most likely one
        assert out.logprobs[j] == pytest.approx(values[0].item(), abs=atol)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), ParallelSpec(block_size=16, kv_page_tokens=16, num_kv_blocks=32,
                                           max_num_batched_tokens=32), dtype="float32") as one:
        yield one


def test_prompt_and_top_logprobs_equal_transformers(checkpoint, llm):
    prompts = _prompts()
    outs = llm.generate(prompts, ASK)
    # The same prompt again: its blocks are cached, yet every position is scored.
    again = llm.generate([prompts[1]], ASK)[0]
    plain = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    for out, prompt in zip(outs, prompts, strict=True):
        _check(checkpoint, out, prompt)
    _check(checkpoint, again, prompts[1])
    assert plain.prompt_logprobs is None and plain.top_logprobs is None
    assert plain.num_cached_prompt_tokens > 0  # a request that does not ask keeps its cache hits


def test_a_prompt_row_scored_one_position_off_is_caught(checkpoint, llm, monkeypatch):
    real = step_input._prompt_rows

    def shifted(seq, start, end, first_row):  # each row scores the token it was fed
        rows = real(seq, start, end, first_row)
        if rows is not None:
            lo = max(start, len(seq.prompt_logprobs))
            rows.targets = seq.token_ids[lo:lo + len(rows.targets)]
        return rows

    monkeypatch.setattr(step_input, "_prompt_rows", shifted)
    prompt = _prompts()[1]
    out = llm.generate([prompt], ASK)[0]
    with pytest.raises(AssertionError):
        _check(checkpoint, out, prompt)


@pytest.mark.slow
def test_pd_prompt_logprobs_equal_transformers(checkpoint):
    pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    spec = compose(["model=hf", f"model.path={checkpoint}", "drafter=none", "prefill=pp2", "decode=tp2",
                    "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16",
                    "decode.kv_page_tokens=16", "prefill.num_kv_blocks=32", "decode.num_kv_blocks=32",
                    "prefill.max_num_batched_tokens=32", "decode.max_num_batched_tokens=32"])
    prompts = _prompts()
    with Deployment(spec) as d:
        outs = d.generate(prompts, ASK)
        # Not asking for prompt logprobs, the same prompt hits the producer's prefix cache;
        # the count travels with the first token: every full block but the last token's.
        again = d.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=2))[0]
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.error is None
        _check(checkpoint, out, prompt)
    assert again.num_cached_prompt_tokens == (len(prompts[1]) - 1) // 16 * 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlap_logprobs_equal_transformers(checkpoint):
    """On a GPU one rank schedules with overlap (the launched step's logprobs path) and
    runs the Triton kernels and decode graphs; the values still equal transformers'."""
    prompts = _prompts()
    spec = ParallelSpec(block_size=16, kv_page_tokens=16, num_kv_blocks=32, max_num_batched_tokens=32,
                        device="cuda")
    with LLM(str(checkpoint), spec, dtype="float32") as llm:
        assert llm.engine.executor.overlap
        outs = llm.generate(prompts, ASK)
    for out, prompt in zip(outs, prompts, strict=True):
        _check(checkpoint, out, prompt, atol=5e-3)  # Triton's fp32 dots may round through TF32
