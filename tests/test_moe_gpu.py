"""Qwen3-MoE on CUDA: fp32 greedy through the fused MoE kernel (and the decode graphs)
equals transformers; bf16 at Qwen3-30B-A3B's layer shape matches the kernel's reference."""

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

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           mlp_only_layers=[1])


def test_cuda_fp32_moe_greedy_matches_transformers(tmp_path):
    folder = write_random_checkpoint(tmp_path, family="qwen3_moe", layers=4, init_std=0.3, seed=3, moe=MOE)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 40, 33, 70)]
    spec = ParallelSpec(block_size=32, kv_page_tokens=16, num_kv_blocks=64, device="cuda")
    llm = LLM(str(folder), spec, dtype="float32")
    model = llm.instance.executor.stage.model
    assert model.uses_fused_kernels(torch.empty(0, device="cuda"))  # the Triton MoE kernel runs
    outs = llm.generate(prompts, GREEDY)
    assert llm.num_free_kv_blocks == llm.num_kv_blocks
    llm.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                          do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_a3b_layer_bf16_matches_the_reference(tokens):
    from pdflow.kernels.fused_moe import fused_moe, fused_moe_reference, route

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, width, experts = 2048, 768, 128
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g, device="cuda") * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, width, generator=g, device="cuda") * width**-0.5).bfloat16()
    weights, ids = route(torch.randn(tokens, experts, generator=g, device="cuda").bfloat16(), 8, True)
    got = fused_moe(x, w13, w2, weights, ids).float()
    want = fused_moe_reference(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
