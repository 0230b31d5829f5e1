"""The public entry points: lazy ``pdflow.LLM``, RunSpec construction, KV pool sizing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdflow.spec import ParallelSpec
from pdflow.spec.load import compose_spec


def test_import_pdflow_stays_torch_free_until_llm_is_used():
    code = (
        "import sys, pdflow\n"
        "assert 'torch' not in sys.modules\n"
        "pdflow.SamplingParams(temperature=0)\n"
        "assert 'torch' not in sys.modules\n"
        "pdflow.LLM\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spec_decode_loads_its_drafters_only_when_named():
    """``pdflow.engine.sequence`` (imported by the router and a server's supervisor) needs
    only the acceptance stats; the drafters (torch) load when a name needing them is used.
    The package's ``verify`` is the function even when the submodule was imported first."""
    code = (
        "import sys, types, pdflow.engine.sequence, pdflow.spec_decode as sd\n"
        "assert 'torch' not in sys.modules\n"
        "from pdflow.spec_decode.verify import verify\n"
        "assert sd.verify is verify and not isinstance(sd.verify, types.ModuleType)\n"
        "from pdflow.spec_decode import Drafter, verify as again\n"
        "assert again is verify and Drafter.__module__ == 'pdflow.spec_decode.drafter'\n"
        "assert all(getattr(sd, name) is not None for name in sd.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llm_from_run_spec_serves_a_random_model_of_the_spec_geometry():
    from pdflow import LLM, SamplingParams

    spec = compose_spec(["model=tiny", "model.path=null", "decode=tp1", "decode.num_kv_blocks=12",
                         "decode.kv_page_tokens=32", "prefill.kv_page_tokens=32", "drafter=none"])
    llm = LLM.from_run_spec(spec)
    assert llm.num_kv_blocks == 12 and llm.kv_usage == 0.0
    cfg = llm.engine.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == (8, 256, 4)
    cache = llm.instance.executor.stage.kv.caches[(7, "v")]
    assert tuple(cache.shape) == (12, 4, 4, 32, 64)
    seen_usage = []
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for _ in llm.stream([[1, 2, 3], list(range(5, 100))], params):
        seen_usage.append(llm.kv_usage)
    assert max(seen_usage) > 0 and llm.num_free_kv_blocks == 12


def test_pool_size_is_the_graphs_budget():
    from pdflow import LLM
    from pdflow.graph import build_graph

    spec = compose_spec(["model.path=null", "mode=monolithic", "decode=tp1", "decode.memory=0.02", "drafter=none"])
    budget = build_graph(spec).budgets["decode"]
    assert not budget.fixed and budget.pool_blocks > 0
    llm = LLM.from_run_spec(spec)
    assert llm.num_kv_blocks == budget.pool_blocks
    fixed = compose_spec(["model.path=null", "decode=tp1", "decode.num_kv_blocks=7", "drafter=none"])
    assert LLM.from_run_spec(fixed).num_kv_blocks == 7


def test_bfloat16_on_cpu_keeps_weights_and_cache_in_bf16():
    from pdflow import LLM, SamplingParams
    from pdflow.spec import ModelSpec

    model = ModelSpec(name="t", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=100, max_model_len=256)
    llm = LLM(model, ParallelSpec(block_size=16, kv_page_tokens=8, num_kv_blocks=16),
              dtype="bfloat16")
    assert {p.dtype for p in llm.instance.executor.stage.model.parameters()} == {torch.bfloat16}
    assert llm.instance.executor.stage.kv.caches[(1, "v")].dtype == torch.bfloat16
    outs = llm.generate([[1, 2, 3], list(range(40))],
                        SamplingParams(temperature=0.8, seed=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 and all(0 <= t < 100 for t in o.token_ids) for o in outs)
    assert llm.num_free_kv_blocks == 16


def test_from_run_spec_goes_through_init_and_refuses_mixed_arguments():
    from pdflow import LLM
    from pdflow.spec import ModelSpec

    class Counted(LLM):
        inits = 0

        def __init__(self, *args, **kwargs):
            type(self).inits += 1
            super().__init__(*args, **kwargs)

    spec = compose_spec(["model.path=null", "prefill=tp1", "prefill.num_kv_blocks=4", "drafter=none"])
    llm = Counted.from_run_spec(spec, "prefill")
    assert Counted.inits == 1 and isinstance(llm, Counted)
    assert llm.engine.role == "prefill" and llm.engine.spec is spec and llm.num_kv_blocks == 4
    with pytest.raises(ValueError, match="parallel, seed cannot be applied"):
        LLM(spec, ParallelSpec(), seed=1)
    model = ModelSpec(name="t", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=100, max_model_len=256)
    with pytest.raises(ValueError, match="needs a RunSpec"):
        LLM(model, role="prefill")
    with pytest.raises(TypeError, match="needs a RunSpec"):
        LLM.from_run_spec(model)


def test_bad_prompt_token_lists_are_refused_before_anything_runs():
    """A token list must hold ints inside the vocabulary: a dict, strings, floats, bools or
    out-of-range ids raise ValueError at submit, not an error deep in a rank."""
    from pdflow import LLM, SamplingParams

    spec = compose_spec(["model=tiny", "model.path=null", "decode=tp1", "decode.num_kv_blocks=8",
                         "decode.kv_page_tokens=32", "prefill.kv_page_tokens=32", "drafter=none"])
    llm = LLM.from_run_spec(spec)
    params = SamplingParams(temperature=0, max_tokens=1)
    vocab = llm.engine.config.vocab_size
    for bad in ({"prompt_token_ids": [1, 2]}, ["1", "2"], [1.0, 2.0], [True, 3], [1, vocab], [-1]):
        with pytest.raises(ValueError, match="list of token ids"):
            llm.generate([bad], params)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, vocab - 1]], params)[0].token_ids) == 1
