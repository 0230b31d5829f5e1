"""Qwen3-MoE layers: the sparse block equals transformers' exactly (fp32, CPU), TP ranks'
expert slices sum to the whole, and greedy tokens of a random Qwen3-MoE checkpoint equal
transformers' at TP1, TP2 and PP2, and with the fused kernels forced on (the Triton MoE
kernel in the model, interpreted on CPU). A router that skips the renormalisation, or ranks that
take each other's expert rows, are caught."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # fused kernels forced on below run interpreted
    os.environ["TRITON_INTERPRET"] = "1"

import transformers  # noqa: E402

from pdflow import LLM, SamplingParams  # noqa: E402
from pdflow.model import fused  # noqa: E402
from pdflow.model.config import DecoderConfig  # noqa: E402
from pdflow.model.hf_checkpoint import write_random_checkpoint  # noqa: E402
from pdflow.model.moe import SparseMoeBlock  # noqa: E402
from pdflow.spec import ParallelSpec  # noqa: E402

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Layer 1 dense (mlp_only_layers), the others sparse: a PP2 cut has both kinds per stage.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           mlp_only_layers=[1])
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3, 77, 150, 42, 9, 11, 13, 190, 64, 8, 4, 33]]


def _hf_block(renormalize: bool, seed: int = 0):
    cfg = transformers.Qwen3MoeConfig(hidden_size=48, num_experts=6, num_experts_per_tok=2,
                                      moe_intermediate_size=20, norm_topk_prob=renormalize)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return cfg, block


def _ours(cfg, hf_block, *, per_expert: bool, tp_rank: int = 0, tp_size: int = 1) -> SparseMoeBlock:
    """Our block loaded from transformers' tensors: its stacked experts, or the released
    per-expert layout (each expert's gate, up and down)."""
    ours = SparseMoeBlock(DecoderConfig.from_hf_dict(cfg.to_dict()), tp_rank, tp_size)
    ours.gate.weight.data.copy_(hf_block.gate.weight)
    gate_up, down = hf_block.experts.gate_up_proj.data, hf_block.experts.down_proj.data
    w13, w2 = ours.experts.gate_up_proj, ours.experts.down_proj
    if per_expert:
        n = gate_up.shape[1] // 2
        for e in range(cfg.num_experts):
            w13.weight_loader(w13, gate_up[e, :n], ("gate", e))
            w13.weight_loader(w13, gate_up[e, n:], ("up", e))
            w2.weight_loader(w2, down[e], ("down", e))
    else:
        w13.weight_loader(w13, gate_up)
        w2.weight_loader(w2, down)
    assert ours.experts.missing() == []
    return ours


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("per_expert", [True, False], ids=["per-expert", "stacked"])
def test_sparse_block_equals_transformers_exactly(renormalize, per_expert):
    cfg, hf = _hf_block(renormalize)
    x = torch.randn(1, 11, cfg.hidden_size)
    got = _ours(cfg, hf, per_expert=per_expert)(x[0])
    assert torch.equal(got, hf(x)[0])


def test_a_router_that_skips_renormalisation_is_caught():
    cfg, hf = _hf_block(True)
    x = torch.randn(11, cfg.hidden_size)
    ours = _ours(cfg, hf, per_expert=True)
    ours.gate.renormalize = False
    assert not torch.allclose(ours(x), hf(x[None]).reshape(11, -1), atol=1e-4)


def test_tp_ranks_expert_slices_sum_to_the_whole_and_swapped_rows_are_caught():
    """Two ranks' partial outputs (the all-reduce's inputs) add to the TP1 output; a rank
    holding the other's down rows (gate/up of one slice, down of another) does not."""
    cfg, hf = _hf_block(True, seed=3)
    x = torch.randn(9, cfg.hidden_size)
    whole = _ours(cfg, hf, per_expert=True)(x)
    r0, r1 = (_ours(cfg, hf, per_expert=True, tp_rank=r, tp_size=2) for r in (0, 1))
    r0.tp_size = r1.tp_size = 1  # each rank's partial sum, before its all-reduce
    torch.testing.assert_close(r0(x) + r1(x), whole, rtol=1e-5, atol=1e-5)
    r0.experts.down_proj.data, r1.experts.down_proj.data = r1.experts.down_proj.data, r0.experts.down_proj.data
    assert not torch.allclose(r0(x) + r1(x), whole, atol=1e-3)


def test_the_capturable_dense_path_equals_the_one_by_one_path():
    """What a CUDA graph captures with the fused kernels off: every expert over every row."""
    from pdflow.model.moe import experts_all_dense, experts_one_by_one

    cfg, hf = _hf_block(True, seed=5)
    ours = _ours(cfg, hf, per_expert=False)
    x = torch.randn(13, cfg.hidden_size)
    weights, ids = ours.gate(x)
    w13, w2 = ours.experts.gate_up_proj, ours.experts.down_proj
    torch.testing.assert_close(experts_all_dense(x, w13, w2, weights, ids),
                               experts_one_by_one(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe")
    return write_random_checkpoint(folder, family="qwen3_moe", layers=4, init_std=0.3, seed=3, moe=MOE)


@pytest.fixture(scope="module")
def hf_tokens(moe_checkpoint):
    """transformers' greedy continuations, refusing an oracle whose top-2 logits nearly tie."""
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs, margin = [], float("inf")
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        top2 = torch.stack(res.scores)[:, 0].topk(2).values
        margin = min(margin, (top2[:, 0] - top2[:, 1]).min().item())
        outs.append(res.sequences[0, len(prompt):].tolist())
    assert margin > 1e-4, f"oracle has a near tie ({margin:.2e}); pick another seed"
    return outs


def _generate(folder, **parallel) -> list[list[int]]:
    spec = dict(block_size=32, kv_page_tokens=16, num_kv_blocks=24, max_num_batched_tokens=32)
    llm = LLM(str(folder), ParallelSpec(**{**spec, **parallel}), dtype="float32")
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.num_free_kv_blocks == llm.num_kv_blocks
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def test_moe_greedy_equals_transformers_tp1(moe_checkpoint, hf_tokens):
    assert _generate(moe_checkpoint) == hf_tokens


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_moe_greedy_equals_transformers_under_tp_and_pp(moe_checkpoint, hf_tokens, layout):
    assert _generate(moe_checkpoint, **layout) == hf_tokens


def test_forced_fused_kernels_run_the_moe_kernel_and_give_transformers_tokens(
        moe_checkpoint, hf_tokens, monkeypatch):
    """The model's layout of the stacked experts is what the kernel reads: fp32 through
    ``kernels.fused_moe`` (and the other fused kernels) gives the same greedy tokens."""
    monkeypatch.setenv(fused.ENV, "on")
    calls = []
    real = fused.ops()
    monkeypatch.setattr(fused, "ops", lambda: fused.FusedOps(
        rms_norm=real.rms_norm, silu_and_mul=real.silu_and_mul, qk_rope_=real.qk_rope_,
        fused_moe=lambda *a: calls.append(a[0].shape[0]) or real.fused_moe(*a)))
    prompts, new = PROMPTS[:1], 4
    llm = LLM(str(moe_checkpoint), ParallelSpec(block_size=32, kv_page_tokens=16, num_kv_blocks=8),
              dtype="float32")
    calls.clear()  # the start-up warm-up's decode step ran the kernel too
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [hf_tokens[0][:new]]
    assert len(calls) == 3 * new  # three sparse layers, a prefill and three decode steps
