"""Overlap scheduling (the host builds step N+1 while the device runs step N), forced on
on CPU: the same tokens as without it for a mixed workload (chunked prefill beside
decodes, stop tokens, EOS, per-request max_tokens, an abort, seeded sampling), every block
back at the end, placeholders filled with the right earlier sample, and where it is
refused or resolved off."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pdflow import LLM, SamplingParams
from pdflow.engine import llm_engine
from pdflow.engine.block_manager import BlockManager
from pdflow.engine.scheduler import Scheduler
from pdflow.engine.sequence import Sequence
from pdflow.engine.step_input import build_step_input
from pdflow.graph import Code, build_graph, overlap_scheduling
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.spec import ParallelSpec
from pdflow.spec.load import compose_spec

# Lengths around the 64-token budget: the 70- and 90-token prompts prefill in chunks
# while the others decode.
PROMPT_LENS = (5, 70, 17, 90, 9, 33)
MAX_TOKENS = (12, 3, 20, 1, 8, 16)
ABORTED = "r5"  # aborted once it has this many tokens
ABORT_AFTER = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", init_std=0.3, seed=2)


def make_llm(folder, overlap: bool | None, device: str = "cpu") -> LLM:
    block, page = (16, 8) if device == "cpu" else (32, 16)  # test_engine_gpu's CUDA pages
    spec = ParallelSpec(block_size=block, kv_page_tokens=page, num_kv_blocks=48, max_num_batched_tokens=64,
                        overlap_scheduling=overlap, device=device)
    return LLM(str(folder), spec, dtype="float32")


@pytest.fixture(scope="module")
def llms(folder):
    off, on = make_llm(folder, False), make_llm(folder, True)
    yield off, on
    off.shutdown()
    on.shutdown()


def prompts() -> list[list[int]]:
    return [[3 + (7 * i + j) % 100 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def params(stops: dict[int, int]) -> list[SamplingParams]:
    """Greedy with EOS ignored unless told; r2 samples at temperature 0.8 with a seed."""
    out = []
    for i, m in enumerate(MAX_TOKENS):
        kw = dict(temperature=0.0, max_tokens=m, ignore_eos=i != 4)
        if i in stops:
            kw["stop_token_ids"] = [stops[i]]
        if i == 2:
            kw.update(temperature=0.8, top_k=20, seed=1234)
        out.append(SamplingParams(**kw))
    return out


def run(llm: LLM, stops: dict[int, int], eos: set[int], abort: bool = True) -> dict[str, tuple]:
    """Drive the engine step by step; abort ABORTED once it has ABORT_AFTER tokens."""
    engine = llm.engine
    engine.eos_token_ids = eos
    for i, (p, s) in enumerate(zip(prompts(), params(stops), strict=True)):
        engine.add_request(p, s, request_id=f"r{i}")
    got: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPT_LENS))}
    reasons: dict[str, str | None] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got[out.request_id].append((out.token_id, out.logprob))
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if abort and len(got[ABORTED]) == ABORT_AFTER and ABORTED not in reasons:
            assert engine.abort(ABORTED)
            reasons[ABORTED] = "abort"
    assert not engine.has_unfinished()
    assert engine.num_free_kv_blocks == engine.num_kv_blocks  # no block leaks
    return {rid: ([t for t, _ in run], [lp for _, lp in run], reasons.get(rid)) for rid, run in got.items()}


@pytest.fixture(scope="module")
def plain_run(llms):
    """The run without overlap, no stops: where the stop tokens come from."""
    return run(llms[0], {}, set(), abort=False)


def first_new(tokens: list[int], start: int) -> int:
    """The first index from ``start`` whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def stops_from(plain) -> tuple[dict[int, int], set[int], dict[str, int]]:
    """A stop id ending r0 mid-output, an EOS ending r4, a stop r5 never reaches (it is
    aborted first); and the tokens r0 and r4 then get."""
    i0, i4, i5 = first_new(plain["r0"][0], 3), first_new(plain["r4"][0], 2), first_new(plain["r5"][0], 8)
    stops = {0: plain["r0"][0][i0], 5: plain["r5"][0][i5]}
    return stops, {plain["r4"][0][i4]}, {"r0": i0 + 1, "r4": i4 + 1}


def assert_same(a: dict, b: dict) -> None:
    for rid in a:
        tokens_a, lp_a, reason_a = a[rid]
        tokens_b, lp_b, reason_b = b[rid]
        assert tokens_a == tokens_b, rid
        assert reason_a == reason_b, rid
        # Batches differ (a step is scheduled before the last is back), so float sums do.
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(lp_a, lp_b, strict=True)), rid


def test_overlap_gives_the_tokens_of_the_synchronous_engine(llms, plain_run, monkeypatch):
    off, on = llms
    assert (off.engine.executor.overlap, off.engine.executor.depth) == (False, 1)
    assert (on.engine.executor.overlap, on.engine.executor.depth) == (True, 2)
    stops, eos, lengths = stops_from(plain_run)
    steps = []
    submit = on.engine.executor.submit
    monkeypatch.setattr(on.engine.executor, "submit", lambda step: (steps.append(step), submit(step))[1])
    want, got = run(off, stops, eos), run(on, stops, eos)
    assert_same(want, got)
    assert got["r0"][2] == "stop" and got["r4"][2] == "stop" and got["r5"][2] == "abort"
    assert len(got["r0"][0]) == lengths["r0"] and len(got["r4"][0]) == lengths["r4"]
    assert len(got["r5"][0]) == ABORT_AFTER
    assert got["r1"][2] == got["r3"][2] == "length" and len(got["r3"][0]) == 1
    # The run did overlap: decodes read in-flight samples beside prefill chunks.
    assert any(s.placeholder_rows and max(b - a for a, b in itertools.pairwise(s.cu_seqlens_q)) > 1
               for s in steps)
    # max_tokens is known ahead: no request is sampled past it (a stop or abort may cost one).
    sampled = {rid: sum(rid in s.sample_seq_ids for s in steps) for rid in want}
    for i, m in enumerate(MAX_TOKENS):
        rid = f"r{i}"
        assert sampled[rid] <= m and sampled[rid] <= len(got[rid][0]) + 1, rid
        if got[rid][2] == "length":
            assert sampled[rid] == m, rid


def test_placeholders_read_the_sample_of_their_own_sequence(llms, plain_run, monkeypatch):
    """Every placeholder row's token, gathered on the device, is the token the engine later
    emitted at that position; reading a neighbour's sample instead is caught."""
    on = llms[1]
    stops, eos, _ = stops_from(plain_run)
    runner = on.engine.executor.stage.runner
    seen = []
    tensors = runner.tensors

    def recording(step, samples=None):
        ids, positions, meta = tensors(step, samples)
        seen.append((step, ids.tolist()))
        return ids, positions, meta

    monkeypatch.setattr(runner, "tensors", recording)
    outputs = run(on, stops, eos)
    assert check_gathered(seen, on, outputs) > 10

    # The same run reading the previous sampled row of the step in flight (off by one).
    def off_by_one(batch, **kw):
        step, sampled = build_step_input(batch, **kw)
        step.placeholder_samples = [max(0, i - 1) for i in step.placeholder_samples]
        return step, sampled

    seen.clear()
    monkeypatch.setattr(llm_engine, "build_step_input", off_by_one)
    wrong = run(on, stops, eos)
    with pytest.raises(AssertionError):
        check_gathered(seen, on, wrong)


def check_gathered(seen, llm, outputs) -> int:
    """Assert each gathered placeholder id equals the host's token there; how many."""
    tokens = {rid: p + outputs[rid][0] for rid, p in zip(outputs, prompts(), strict=True)}
    checked = 0
    for step, ids in seen:
        spans = itertools.pairwise(step.cu_seqlens_q)
        owner = [rid for rid, (a, b) in zip(step.seq_ids, spans, strict=True) for _ in range(b - a)]
        for row in step.placeholder_rows:
            known = tokens[owner[row]]
            pos = step.positions[row]
            if pos < len(known):  # else: the token of a request that ended (it is dropped)
                assert ids[row] == known[pos], (step.step, owner[row], pos)
                checked += 1
    return checked


def test_a_request_finished_in_flight_keeps_its_blocks_until_that_step_is_back(llms):
    engine = llms[1].engine
    rid = engine.add_request(prompts()[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    seq = engine.scheduler.find(rid)
    engine.step()  # prefill collected; its first decode is in flight
    assert seq.in_flight and engine.num_free_kv_blocks < engine.num_kv_blocks
    engine.abort(rid)
    held = list(seq.block_table)
    assert held and all(engine.blocks.blocks[b].ref_count == 1 for b in held)  # still written into
    assert engine.step() == []  # its in-flight token is dropped
    assert not seq.block_table and engine.num_free_kv_blocks == engine.num_kv_blocks


def _submitted(batch, number: int) -> None:
    """What submitting a step does to its sequences (LLMEngine._fill_pipeline)."""
    for index, seq in enumerate(batch.seqs):
        seq.in_flight, seq.last_step = True, number
        seq.sampled_at, seq.sample_index = number, index


def test_scheduler_runs_ahead_within_max_tokens_and_preempts_nothing_in_flight():
    blocks = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(blocks, max_num_batched_tokens=64, max_num_seqs=8, overlap=True)
    a = Sequence(request_id="a", token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams(max_tokens=2))
    b = Sequence(request_id="b", token_ids=[1, 2, 3, 4], num_prompt_tokens=4, sampling=SamplingParams(max_tokens=9))
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [a, b] and first.ahead == [False, False] and blocks.num_free_blocks == 0
    _submitted(first, 0)
    # a decodes its in-flight token at position 3 (its block has room); b would need a
    # second block and every other sequence is in flight: b waits, nobody is preempted.
    second = sched.schedule()
    assert second.seqs == [a] and second.ahead == [True] and b.num_preemptions == 0
    step, _ = build_step_input(second, block_size=4, step=1, released=[])
    assert (step.placeholder_rows, step.placeholder_samples, step.placeholder_step) == ([0], [0], 0)
    assert step.positions == [3] and step.token_ids == [0]
    _submitted(second, 1)
    a.num_computed_tokens, a.token_ids = 3, [1, 2, 3, 7]  # step 0 collected: a has 1 of 2 tokens
    assert not sched.runs_ahead(a)  # its second token is in flight: a third would pass max_tokens


def test_overlap_resolves_on_only_where_it_can_run():
    def spec(*overrides):
        return compose_spec(["drafter=none", "decode=tp1", *overrides])

    assert overlap_scheduling(spec("decode.device=cuda"), "consumer")
    assert not overlap_scheduling(spec(), "consumer")  # auto: CUDA only
    assert overlap_scheduling(spec("decode.overlap_scheduling=true"), "consumer")
    assert not overlap_scheduling(spec("decode.device=cuda", "decode.overlap_scheduling=false"), "consumer")
    assert not overlap_scheduling(spec("decode.device=cuda", "decode.pp=2"), "consumer")
    assert not overlap_scheduling(compose_spec(["decode=tp1", "decode.device=cuda"]), "consumer")  # drafter
    refused = build_graph(spec("decode.pp=2", "decode.overlap_scheduling=true")).validate()
    assert [r.code for r in refused] == [Code.OVERLAP_UNSUPPORTED]
    assert "decode.overlap_scheduling" in refused[0].fix


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlap_with_graphs_gives_the_synchronous_tokens(folder):
    """On CUDA (auto: on), decode steps replay graphs whose input ids were gathered on the
    device from the step before; the outputs equal overlap off's."""
    off, on = make_llm(folder, False, "cuda"), make_llm(folder, None, "cuda")
    try:
        assert on.engine.executor.overlap and not off.engine.executor.overlap
        plain = run(off, {}, set(), abort=False)
        stops, eos, _ = stops_from(plain)
        assert_same(run(off, stops, eos), run(on, stops, eos))
        assert on.engine.graph_steps > 0
    finally:
        off.shutdown()
        on.shutdown()
