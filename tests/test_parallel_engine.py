"""TP and PP instances over torch.distributed (gloo, CPU): same greedy tokens as one
process, drafter taps relayed to the last stage exactly, and a dead rank ends the
instance with an error naming it."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from parallel_probe import alive

from pdflow import LLM, SamplingParams
from pdflow.parallel.launcher import RankFailed
from pdflow.spec.load import compose_spec

pytestmark = pytest.mark.slow

PROMPTS = [
    "Question: Mira has 12 apples. Mira buys 7 more apples. How many apples does Mira have now?\nAnswer:",
    "Question: Omar has 30 shells. Omar loses 4 shells. Omar finds 9 more shells. How many shells "
    "does Omar have now?\nAnswer:",
    "The vault code of Ines is 5821. The river was calm that morning. What is the vault code of Ines?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Small chunks so prefill spans several steps and PP stages see chunked batches.
BASE = ["drafter=none", "decode.num_kv_blocks=48", "decode.block_size=32", "decode.kv_page_tokens=16",
        "prefill.block_size=32", "prefill.kv_page_tokens=16", "decode.max_num_batched_tokens=48"]


def generate(*overrides: str) -> list[list[int]]:
    llm = LLM.from_run_spec(compose_spec([*BASE, *overrides]))
    try:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def single_process_tokens() -> list[list[int]]:
    return generate("decode.tp=1", "decode.pp=1")


@pytest.mark.parametrize(
    "layout",
    [
        ("decode.tp=2",),
        ("decode.tp=4",),
        ("decode.tp=8",),
        ("decode.tp=1", "decode.pp=2"),
        ("decode.tp=1", "decode.pp=4"),
        ("decode.tp=1", "decode.pp=4", "decode.partition=lighter_last"),
        ("decode.tp=2", "decode.pp=2"),
    ],
    ids=["tp2", "tp4", "tp8(replicated kv heads)", "pp2", "pp4", "pp4-uneven(3,2,2,1)", "pp2xtp2"],
)
def test_greedy_tokens_equal_one_process(single_process_tokens, layout):
    assert generate(*layout) == single_process_tokens


def test_taps_relayed_to_the_last_stage_equal_single_process_hidden_states():
    from pdflow.attention.backends import get_backend
    from pdflow.attention.kv_cache import KVCacheBinding
    from pdflow.graph import build_graph
    from pdflow.model.config import DecoderConfig
    from pdflow.model.loader import build_model
    from pdflow.model.paths import resolve_model_path
    from pdflow.parallel.messages import SamplingSpec, StepInput
    from pdflow.worker.executors import MultiProcessExecutor
    from pdflow.worker.stage_runner import StageRunner

    taps = [1, 3, 5, 7]  # one per stage of PP4 over 8 layers
    spec = compose_spec([*BASE[1:], "drafter=dspark", "drafter.path=random", f"drafter.taps=[{','.join(map(str, taps))}]",
                         "decode.tp=1", "decode.pp=4"])
    graph = build_graph(spec).raise_if_refused()
    assert [s.taps_captured for s in graph.consumer.stages] == [(1,), (3,), (5,), (7,)]

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(4, 100, (35,), generator=gen).tolist(), torch.randint(4, 100, (12,), generator=gen).tolist()

    def step(n, chunks):  # chunks: (seq id, tokens, start position, block table)
        ids, pos, slots, cu, ctx, tables = [], [], [], [0], [], []
        for _, toks, start, table in chunks:
            ids += toks
            pos += list(range(start, start + len(toks)))
            slots += [table[p // 32] * 32 + p % 32 for p in range(start, start + len(toks))]
            cu.append(cu[-1] + len(toks))
            ctx.append(start + len(toks))
            tables.append(table)
        return StepInput(step=n, seq_ids=[c[0] for c in chunks], token_ids=ids, positions=pos,
                         slot_mapping=slots, cu_seqlens_q=cu, context_lens=ctx, block_tables=tables,
                         sample_rows=[cu[-1] - 1], sample_seq_ids=[chunks[-1][0]],
                         sampling=[SamplingSpec()], capture_taps=True, context_adopt=[-1] * len(chunks))

    steps = [step(0, [("a", a[:20], 0, [0, 1]), ("b", b, 0, [2, 3])]), step(1, [("a", a[20:], 20, [0, 1])])]

    folder = resolve_model_path(spec.model.path)
    model = build_model(DecoderConfig.from_file(folder), folder=folder, dtype=torch.float32,
                        device=torch.device("cpu"))
    # The four TP1 stages together hold every layer's units: bind them all to one model.
    units = [u for r in graph.consumer.ranks for u in r.target_units]
    KVCacheBinding(units, 8, torch.device("cpu")).bind(model.attention_layers(), get_backend("torch"))
    local = StageRunner(model, torch.device("cpu"), capture_layers=tuple(taps))

    executor = MultiProcessExecutor(graph, "decode")
    try:
        for s in steps:
            out = executor.execute(s)
            relayed = np.frombuffer(out.taps, dtype=np.float32).reshape(out.taps_shape)
            ids, positions, meta = local.tensors(s)
            with torch.inference_mode():
                _, want = local.forward(ids, positions, meta)
            assert relayed.shape == (len(s.token_ids), len(taps) * model.config.hidden_size)
            np.testing.assert_allclose(relayed, want.numpy(), rtol=1e-5, atol=1e-5)
    finally:
        executor.shutdown()


def test_killed_rank_ends_the_instance_naming_it_and_leaves_no_process():
    import time

    llm = LLM.from_run_spec(compose_spec([*BASE, "decode.tp=1", "decode.pp=2", "decode.step_timeout_s=60"]))
    pids = llm.instance.executor.pids
    assert len(pids) == 2 and all(alive(p) for p in pids)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))
    os.kill(pids[1], signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(RankFailed, match=r"decode\.s1\.t0"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert time.monotonic() - began < 30
    assert not any(alive(p) for p in pids)


def test_pp_keeps_one_step_in_flight_per_stage(single_process_tokens):
    """PP2 submits the next step before the last one is back (stage 0 works on it while
    stage 1 finishes the other), and the tokens still equal one process's."""
    llm = LLM.from_run_spec(compose_spec([*BASE, "decode.tp=1", "decode.pp=2"]))
    try:
        got = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert llm.instance.executor.depth == 2
        assert llm.instance.executor.max_in_flight == 2
    finally:
        llm.shutdown()
    assert got == single_process_tokens


def test_abort_while_in_flight_frees_blocks_and_drops_the_late_token(single_process_tokens):
    llm = LLM.from_run_spec(compose_spec([*BASE, "decode.tp=1", "decode.pp=2"]))
    engine = llm.engine
    try:
        ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
        a = engine.add_request(ids[0], GREEDY)
        b = engine.add_request(ids[1], GREEDY)
        tokens_a = [out.token_id for out in engine.step()]  # a's step collected, b's in flight
        seq_b = engine.scheduler.find(b)
        assert seq_b.in_flight and engine.scheduler.find(a) is not None
        assert engine.abort(b)
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id == a, "a token of the aborted request came back"
                tokens_a.append(out.token_id)
        assert seq_b.num_output_tokens == 0
        assert engine.num_free_kv_blocks == engine.num_kv_blocks
    finally:
        llm.shutdown()
    assert tokens_a == single_process_tokens[0]
