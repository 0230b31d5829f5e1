"""The speed scripts' step trace: each step's attention path, eager op calls and graph
flag as the stage runner took them, and the instance untouched once detached."""

from __future__ import annotations

from pdflow import SamplingParams
from pdflow.bench.step_trace import StepTrace
from pdflow.engine.llm import LLM
from pdflow.spec.load import compose_spec


def test_trace_records_each_steps_path_and_ops():
    spec = compose_spec(["mode=monolithic", "prefill=tp1", "decode=tp1", "tracking=off", "drafter=none",
                         "decode.device=cpu", "prefill.device=cpu"])
    prompt = "12+34=" * 30  # 180 tokens: one prefill, then a prefix-hit tail of 53 tokens
    with LLM.from_run_spec(spec, role="decode") as llm:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
        executor = llm.engine.instance.executor
        with StepTrace(llm.engine) as trace:
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert "execute" not in vars(executor)  # detached
        backend = executor.stage.model.attention_layers()[0].backend
        assert "decode_attention" not in vars(backend)
    layers = spec.model.layers
    paths = [(r.path, r.rows, r.graphed) for r in trace.records]
    # on the CPU the tail is one prefill (a GPU takes it as decode rows: runs_as_decode_rows)
    assert paths == [("prefill", 181 - 128, False), ("decode", 1, False), ("decode", 1, False)]
    assert trace.records[0].ops == {"prefill_attention": layers, "store_kv": layers}
    assert "3 steps (0 graphed)" in trace.summary()
    assert trace.kernels_built() in (None, 0)  # CPU: nothing compiled (None: every kernel interpreted)
