"""The start-up warm-up: every compile happens before an instance is ready (and so before
it answers /health), none inside a request, and its time reaches the metrics.

Builds and loads of the CPU op and every rank's warm-up are appended to
``$PDFLOW_COMPILE_LOG`` by the processes doing them, so the tests see ranks from outside.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from pdflow.attention import jit_build
from pdflow.worker.stage_runner import ROWS_AS_DECODE, SHORT_STEP_ROWS, runs_as_decode_rows
from pdflow.worker.warm_up import decode_batches, shape_classes, warm_step


def _splits(b: int) -> int:  # the decode kernel's rule at 4 KV heads on 132 SMs (MAX_SPLITS 32)
    return max(1, min(32, -(-264 // (b * 4))))


def _int_class(n: int) -> str:  # how Triton specializes an integer argument
    return "one" if n == 1 else "x16" if n % 16 == 0 else "other"


def test_gpu_shape_classes_meet_every_integer_class_split_count_and_step_path():
    classes = shape_classes(512, max_num_seqs=64, split_of=_splits)
    prefill = [c for c in classes if not runs_as_decode_rows(list(c.q_lens)) and max(c.q_lens) > 1]
    rows = [c for c in classes if runs_as_decode_rows(list(c.q_lens))]
    decode = [c for c in classes if max(c.q_lens) == 1]
    assert {_int_class(sum(c.q_lens)) for c in prefill} == {"x16", "other"}
    assert any(len(c.q_lens) > 1 for c in prefill)  # several sequences in one prefill
    assert any(c.context_lens[0] > c.q_lens[0] for c in prefill)  # a chunk after a prefix
    assert {max(c.q_lens) for c in rows} >= {ROWS_AS_DECODE}  # a verify's rows
    assert any(sum(c.q_lens) > ROWS_AS_DECODE for c in rows)  # a short step
    assert {_int_class(len(c.q_lens)) for c in decode} == {"one", "x16", "other"}
    # eager decode rows reach SHORT_STEP_ROWS (a short step's rows), past max_num_seqs
    assert {_splits(len(c.q_lens)) for c in decode} == {_splits(b) for b in range(1, SHORT_STEP_ROWS + 1)}
    for c in classes:
        assert sum(c.q_lens) <= 512 and max(c.context_lens) <= 512
        assert all(q <= ctx for q, ctx in zip(c.q_lens, c.context_lens, strict=True))


def test_the_warm_up_meets_both_sides_of_each_prefill_kernel_break_the_budget_reaches():
    """The warm-up's own prefills stop at 512 tokens; a d64 model's Gluon prefill takes three
    warpgroups from 4,096, so without the breaks a step budget of 16,384 tokens compiled
    that kernel inside the first long prompt's request."""
    def sides(classes, brk):
        prefills = [c for c in classes if not runs_as_decode_rows(list(c.q_lens)) and max(c.q_lens) > 1]
        return ({_int_class(max(c.q_lens)) for c in prefills if SHORT_STEP_ROWS < max(c.q_lens) < brk},
                {_int_class(max(c.q_lens)) for c in prefills if max(c.q_lens) >= brk})

    plain = shape_classes(512, max_num_seqs=64, split_of=_splits)
    assert sides(plain, 4096) == ({"x16", "other"}, set())  # the gap
    classes = shape_classes(512, max_num_seqs=64, split_of=_splits, prefill_breaks=(4096,), max_step_tokens=16384)
    assert sides(classes, 4096) == ({"x16", "other"}, {"x16", "other"})
    for c in classes:
        assert sum(c.q_lens) <= 16384 and all(q <= ctx <= 16384 for q, ctx in zip(c.q_lens, c.context_lens,
                                                                                 strict=True))
    # a budget of exactly the break reaches only its x16 side; one below it, nothing
    assert sides(shape_classes(512, max_num_seqs=64, split_of=_splits, prefill_breaks=(4096,),
                               max_step_tokens=4096), 4096)[1] == {"x16"}
    assert shape_classes(512, max_num_seqs=64, split_of=_splits, prefill_breaks=(4096,),
                         max_step_tokens=4095) == plain
    # warm prefills past the break already (a large warm-up budget): the side below is added
    big = shape_classes(16384, max_num_seqs=64, split_of=_splits, prefill_breaks=(4096,), max_step_tokens=16384)
    assert sides(big, 4096) == ({"x16", "other"}, {"x16", "other"})
    assert sides(shape_classes(16384, max_num_seqs=64, split_of=_splits), 4096)[0] == set()


def test_the_prefill_kernel_changes_schedule_only_at_its_length_breaks():
    import torch
    from pdflow.kernels.prefill_auto import length_breaks
    from pdflow.kernels.prefill_gluon import default_schedule

    for d in (64, 128):
        changes = tuple(n for n in range(2, 70000) if default_schedule(d, n) != default_schedule(d, n - 1))
        assert changes == length_breaks(d, torch.bfloat16), d
    assert length_breaks(1, torch.uint8) == ()  # an fp8 cache's scale unit
    for other in (torch.float32, torch.float16, torch.float8_e4m3fn):  # not the Gluon kernel's caches
        assert length_breaks(64, other) == ()


def test_decode_batches_stay_within_the_rows_and_skip_what_graphs_take():
    assert decode_batches(1, _splits) == [1]
    batches = decode_batches(64, _splits)
    assert max(batches) <= 64 and {1, 3, 16} <= set(batches)
    assert len(batches) <= len({_splits(b) for b in range(1, 65)}) + 3  # one per split count, and 1, 3, 16
    graphed = decode_batches(128, _splits, eager_from=65)
    assert [b for b in graphed if b <= 64] == [1, 3, 16]  # graph captures compiled those splits
    assert {_splits(b) for b in graphed if b > 64} == {_splits(b) for b in range(65, 129)}


def test_cpu_warm_up_is_one_decode_step_and_warm_steps_write_nothing():
    (only,) = shape_classes(512, max_num_seqs=64)
    assert only.q_lens == (1,)
    for i, shape in enumerate(shape_classes(300, max_num_seqs=8, split_of=_splits)):
        step = warm_step(shape, 16, i, num_blocks=10, lookahead=8)
        assert set(step.slot_mapping) == {-1} and step.step < 0
        assert step.cu_seqlens_q[-1] == len(step.token_ids) == len(step.positions)
        # the table covers the context and a proposal's 8 positions past it, within the pool
        assert all(len(t) * 16 >= ctx + 8 for t, ctx in zip(step.block_tables, step.context_lens, strict=True))
        assert max(max(t) for t in step.block_tables) < 10
    assert SHORT_STEP_ROWS < 300


def _events(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_ranks_load_the_cpu_op_in_their_warm_up_before_healthy_and_requests_compile_nothing(
        tmp_path, monkeypatch):
    """A served TP2 instance on CPU: when /health first answers, both ranks have loaded the
    CPU decode op inside their warm-up (after the owner built it); a request then loads,
    builds or warms up nothing, and /metrics and ``pdflow run``'s gauges carry the time."""
    if os.environ.get("PDFLOW_CPU_KERNELS", "1") == "0":
        pytest.skip("PDFLOW_CPU_KERNELS=0 turns the CPU decode op off")
    from pdflow import compose
    from pdflow.cli_run import server_gauges
    from pdflow.serve.launch import serve_spec

    log = tmp_path / "compile.jsonl"
    monkeypatch.setenv(jit_build.COMPILE_LOG_ENV, str(log))
    spec = compose(["mode=monolithic", "decode=tp2", "drafter=none", "tracking=off"])
    with serve_spec(spec, port=0) as served:
        assert httpx.get(f"{served.url}/health").status_code == 200
        ready = _events(log)
        owner = [e for e in ready if e["pid"] == os.getpid()]
        ranks = {e["pid"] for e in ready if e["event"] == "warm_up_end"} - {os.getpid()}
        assert len(ranks) == 2, ready
        for pid in ranks:
            mine = [e["event"] for e in ready if e["pid"] == pid]
            assert mine == ["warm_up_begin", "load", "warm_up_end"], ready
        if owner:  # this test process had not loaded the op before: it did, before any rank
            first_rank = min(e["time"] for e in ready if e["pid"] in ranks)
            assert owner[0]["event"] in ("load", "build") and owner[0]["time"] <= first_rank
        r = httpx.post(f"{served.url}/v1/completions", timeout=120,
                       json={"model": served.model_name, "prompt": "Question: Tom has 3 pens.",
                             "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert _events(log) == ready  # nothing loaded, built or warmed up inside the request
        gauges = server_gauges(served.url, None)
        assert gauges["compile_s"] > 0
        text = httpx.get(f"{served.url}/metrics").text
        assert "pdflow_startup_seconds" in text and "pdflow_compile_seconds" in text


@pytest.mark.slow
def test_the_gpu_warm_up_with_a_drafter_changes_no_output_and_leaves_no_state():
    """The GPU's warm-up (every class, the drafter's eager step included) run on a CPU
    stage before any request: greedy tokens and accepted drafts equal a stage without it,
    and no warm-up request is left in the drafter's ledger."""
    from pdflow import SamplingParams
    from pdflow.engine.llm import LLM
    from pdflow.spec.load import compose_spec
    from pdflow.worker.warm_up import warm_up

    spec = compose_spec(["mode=monolithic", "decode=tp1", "drafter=dspark", "tracking=off",
                         "decode.max_num_batched_tokens=16"])  # small steps: a quick test
    prompts = ["Question: Mira has 12 apples. Mira buys 7 more apples. How many apples does Mira have now?\n"
               "Answer:", "Question: Tom has 3 pens."]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM.from_run_spec(spec, role="decode") as cold:
        want = [(o.token_ids, o.num_accepted) for o in cold.generate(prompts, greedy)]
    with LLM.from_run_spec(spec, role="decode") as warm:
        stage = warm.engine.instance.executor.stage
        assert warm_up(stage, full=True) > 0
        assert not stage.drafting.proposed and not stage.drafting.drafter.ledger.valid
        got = [(o.token_ids, o.num_accepted) for o in warm.generate(prompts, greedy)]
    assert got == want
    assert sum(a for _, a in want) > 0  # drafts were accepted: the draft pool was read
