"""Greedy generation equals transformers token for token (fp32, CPU), whatever the page,
the chunking or the prefix-cache hits."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdflow import LLM, SamplingParams
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec

NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 40, 64, 33)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Large init keeps argmax margins far above fp32 noise (checked below, not assumed).
CHECKPOINTS = {
    "llama": dict(
        family="llama", init_std=0.3, seed=0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "qwen3": dict(family="qwen3", init_std=0.3, seed=1, tie_word_embeddings=True),
}


def hf_greedy(folder, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (computed once per prompt)."""
    key = str(folder)
    missing = [p for p in prompts if (key, tuple(p)) not in _HF_CACHE]
    if missing:
        for p, out in zip(missing, _hf_greedy(folder, missing), strict=True):
            _HF_CACHE[(key, tuple(p))] = out
    return [_HF_CACHE[(key, tuple(p))] for p in prompts]


_HF_CACHE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _hf_greedy(folder, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations, refusing an oracle whose top-2 logits nearly tie."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # No EOS: generation runs on through it unaltered (min_new_tokens would mask it instead).
    model.generation_config.eos_token_id = None
    outs, margin = [], float("inf")
    for prompt in prompts:
        ids = torch.tensor([prompt])
        res = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
        top2 = torch.stack(res.scores)[:, 0].topk(2).values
        margin = min(margin, (top2[:, 0] - top2[:, 1]).min().item())
        outs.append(res.sequences[0, len(prompt):].tolist())
    assert margin > 1e-4, f"oracle has a near tie ({margin:.2e}); pick another seed"
    return outs


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return write_random_checkpoint(folder, **CHECKPOINTS[request.param])


def random_prompts(seed: int, lens=PROMPT_LENS, prefix: list[int] | None = None):
    gen = torch.Generator().manual_seed(seed)
    head = prefix or []
    return [head + torch.randint(3, 200, (n,), generator=gen).tolist() for n in lens]


def make_llm(folder, **parallel) -> LLM:
    spec = dict(block_size=32, kv_page_tokens=16, num_kv_blocks=64, max_num_batched_tokens=512)
    spec.update(parallel)
    return LLM(str(folder), ParallelSpec(**spec), dtype="float32")


@pytest.mark.parametrize(
    "parallel",
    [
        dict(),  # page 16 in a 32-token block
        dict(kv_page_tokens=32),  # page == block
        dict(max_num_batched_tokens=16),  # chunked prefill, decode mixed into chunks
        dict(block_size=16, kv_page_tokens=16, max_num_seqs=2),  # few seqs at a time
    ],
    ids=["page16", "page32", "chunked16", "seqs2"],
)
def test_greedy_matches_transformers(checkpoint, parallel):
    prompts = random_prompts(seed=7)
    llm = make_llm(checkpoint, **parallel)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(checkpoint, prompts)
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.num_free_kv_blocks == llm.num_kv_blocks


def test_greedy_matches_transformers_through_gather_decode(checkpoint, monkeypatch):
    """Decode through gather + matmuls (the path when the fused CPU op cannot build)."""
    from pdflow.attention import cpu_decode

    monkeypatch.setattr(cpu_decode, "usable", lambda *a: False)
    prompts = random_prompts(seed=7)
    outs = make_llm(checkpoint).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(checkpoint, prompts)


def test_fast_model_ops_equal_the_plain_ones():
    """The fp32 shortcuts (fused RMSNorm, q and k rotated in one pass) change no bit."""
    from pdflow.model.layers import RMSNorm
    from pdflow.model.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=gen)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 64, generator=gen) * 3
        plain = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.equal(norm(x), plain)
    rope = RotaryEmbedding(16, 10000.0, None, 64)
    qk = torch.randn(5, 6, 16, generator=gen)
    pos = torch.tensor([0, 3, 9, 4, 63])
    q, k = rope(pos, qk[:, :4], qk[:, 4:])
    assert torch.equal(rope.forward_joint(pos, qk), torch.cat([q, k], dim=1))
    other = torch.tensor([1, 1, 1, 1, 1])  # a new positions tensor: no stale table
    assert not torch.equal(rope.forward_joint(other, qk), rope.forward_joint(pos, qk))


@pytest.mark.parametrize("chunk", [512, 16])
def test_prefix_cache_hits_keep_tokens_exact(checkpoint, chunk):
    shared = random_prompts(seed=4, lens=(70,))[0]
    prompts = random_prompts(seed=12, lens=(3, 20, 9), prefix=shared)
    llm = make_llm(checkpoint, max_num_batched_tokens=chunk)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:] + prompts[:1], GREEDY)
    # The 70-token prefix fills two 32-token blocks; every later prompt reuses both.
    assert [o.num_cached_prompt_tokens for o in rest] == [64, 64, 64]
    expected = hf_greedy(checkpoint, prompts)
    assert [o.token_ids for o in first + rest] == [expected[0], *expected[1:], expected[0]]
    assert llm.num_free_kv_blocks == llm.num_kv_blocks


def test_text_prompts_use_the_checkpoint_tokenizer(checkpoint):
    llm = make_llm(checkpoint)
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}])
    assert chat.endswith("<assistant> ") and "w5 w6 w7" in chat
    texts = ["w1 w2 w3 w4", chat]
    ids = [tok.encode(t) for t in texts]
    by_text = llm.generate(texts, GREEDY)
    assert [o.prompt_token_ids for o in by_text] == ids
    assert [o.token_ids for o in by_text] == hf_greedy(checkpoint, ids)
    assert by_text[0].text == tok.decode(by_text[0].token_ids)
