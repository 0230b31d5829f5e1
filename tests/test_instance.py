"""The instance object and the executor contract: one side of a run graph that transfer,
drafters and serving attach to, and ``LLM`` as a thin driver over it."""

from __future__ import annotations

import pytest
import torch

from pdflow import LLM, SamplingParams
from pdflow.engine.executor import Executor
from pdflow.engine.instance import Instance
from pdflow.engine.llm_engine import LLMEngine
from pdflow.spec import ParallelSpec
from pdflow.spec.load import compose_spec
from pdflow.worker.executors import InProcessExecutor

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SPEC = ["model.path=null", "decode=tp1", "decode.num_kv_blocks=8", "decode.kv_page_tokens=16",
        "prefill.kv_page_tokens=16", "drafter=none"]


def test_instance_holds_its_pools_by_the_graphs_unit_names():
    spec = compose_spec(SPEC)
    with Instance(spec, "decode") as inst:
        assert isinstance(inst.executor, Executor) and isinstance(inst.executor, InProcessExecutor)
        names = set(inst.units(0))
        assert names == {u.name for u in inst.graph.rank("decode", 0).units}
        caches = inst.kv_caches()
        assert set(caches) == names
        for name, unit in inst.units(0).items():
            assert tuple(caches[name].shape) == unit.cache_shape(inst.num_kv_blocks)
        # The attention layers write exactly these tensors: a step changes them.
        layer0 = next(n for n in names if n.endswith(".k.layer_0"))
        before = caches[layer0].clone()
        engine = LLMEngine(inst)
        engine.add_request([1, 2, 3, 4, 5], GREEDY)
        while engine.has_unfinished():
            engine.step()
        assert not torch.equal(before, caches[layer0])
    assert inst.executor is None
    with pytest.raises(RuntimeError, match="shut down"):
        LLMEngine(inst).step()


def test_instance_refuses_an_unknown_role():
    with pytest.raises(ValueError, match="role must be one of"):
        Instance(compose_spec(SPEC), "both-ways")


def test_a_multi_process_instance_says_where_its_pools_are():
    spec = compose_spec([*SPEC, "decode.tp=2"])
    with Instance(spec, "decode") as inst:
        assert len(inst.ranks) == 2 and inst.executor.depth == 1
        assert {u.heads for u in inst.units(1).values()} == {(2, 3)}
        with pytest.raises(RuntimeError, match="rank processes"):
            inst.kv_caches()


def test_a_string_prompt_is_one_request():
    with LLM("pdflow:assets/tiny", ParallelSpec(num_kv_blocks=8)) as llm:
        outs = llm.generate("Hello", GREEDY)
        assert len(outs) == 1 and len(outs[0].token_ids) == 4
        assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello")
        ids = llm.tokenizer.encode("Hello")
        assert [o.token_ids for o in llm.generate(ids, GREEDY)] == [outs[0].token_ids]
        assert len(llm.generate(["Hello", "Hi"], GREEDY)) == 2


def test_one_instance_defaults_its_page_to_the_block():
    """No transfer, so no page to agree on: the page is the block unless one is given."""
    with LLM("pdflow:assets/tiny", ParallelSpec(tp=1, block_size=32, num_kv_blocks=8)) as llm:
        assert {u.page_tokens for u in llm.instance.units(0).values()} == {32}
    with LLM("pdflow:assets/tiny", ParallelSpec(block_size=32, kv_page_tokens=16, num_kv_blocks=8)) as llm:
        assert {u.page_tokens for u in llm.instance.units(0).values()} == {16}
