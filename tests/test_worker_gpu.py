"""Worker seam on the GPU: TP and PP ranks replay CUDA graphs for decode like the single
process does (same tokens as eager), and shutting an LLM down gives its memory back."""

from __future__ import annotations

import gc

import pytest
import torch

from pdflow import LLM, SamplingParams
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GIB = 1 << 30
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


MODEL = "pdflow:assets/tiny"


def _prompts(n=6):
    """In-domain prompts (five-shot arithmetic), where the shipped model is decided."""
    from pdflow.bench.tasks import arith_eval_set

    return [it.prompt for it in arith_eval_set(n, k_shot=5, seed=11)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_multi_rank_decode_replays_cuda_graphs_with_eager_tokens(layout):
    folder = MODEL
    base = dict(device="cuda", block_size=128, kv_page_tokens=16, num_kv_blocks=64,
                attention_backend="triton", **layout)
    with LLM(folder, ParallelSpec(**base, enforce_eager=True), dtype="bfloat16") as eager_llm:
        eager = [o.token_ids for o in eager_llm.generate(_prompts(), GREEDY)]
        assert eager_llm.engine.graph_steps == 0
    with LLM(folder, ParallelSpec(**base, enforce_eager=False), dtype="bfloat16") as llm:
        got = [o.token_ids for o in llm.generate(_prompts(), GREEDY)]
        # Every decode step (all but the prefill steps) came back from a replayed graph.
        assert llm.engine.graph_steps > 0
        assert llm.engine.graph_steps >= llm.engine.steps - len(_prompts()) * 2
    assert got == eager


def test_two_llms_in_one_process_the_memory_comes_back(tmp_path):
    folder = str(write_random_checkpoint(tmp_path, family="llama", seed=0))
    total_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    par = ParallelSpec(device="cuda", memory=0.85, device_memory_gib=total_gib,
                       attention_backend="triton", kv_page_tokens=128)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(0)
    for _ in range(2):  # the second one OOMs if the first kept its pool
        with LLM(folder, par, dtype="bfloat16") as llm:
            assert torch.cuda.memory_reserved(0) > before + 0.5 * total_gib * GIB
            assert len(llm.generate(_prompts(2), GREEDY)) == 2
        gc.collect()
        assert torch.cuda.memory_reserved(0) < before + 1 * GIB
