"""The engine on CUDA: fp32 greedy equals transformers; bf16 serves and frees its blocks."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdflow import LLM, SamplingParams
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def spec(**kw) -> ParallelSpec:
    base = dict(block_size=32, kv_page_tokens=16, num_kv_blocks=64, device="cuda")
    return ParallelSpec(**{**base, **kw})


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_fp32_greedy_matches_transformers(tmp_path, family):
    folder = write_random_checkpoint(tmp_path, family=family, init_std=0.3, seed=0)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 40, 33)]
    outs = LLM(str(folder), spec(), dtype="float32").generate(prompts, GREEDY)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_cuda_bf16_serves_and_frees_blocks(tmp_path):
    folder = write_random_checkpoint(tmp_path, family="llama", seed=0)
    llm = LLM(str(folder), spec(max_num_batched_tokens=16), dtype="bfloat16")
    assert llm.instance.executor.stage.kv.caches[(0, "k")].dtype == torch.bfloat16
    outs = llm.generate([[5, 6, 7] * 10, [9] * 3], GREEDY)
    assert [len(o.token_ids) for o in outs] == [32, 32]
    assert llm.num_free_kv_blocks == llm.num_kv_blocks
