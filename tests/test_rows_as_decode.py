"""A step of short queries (a verify of [anchor, k drafts], a short chunk or prefix-hit
tail) runs as one decode row per new token over its own causal prefix; it must attend
exactly as the prefill op over the same step does, and an off-by-one prefix is caught."""

from __future__ import annotations

import pytest
import torch

from pdflow.attention.backends import get_backend
from pdflow.parallel.messages import SamplingSpec, StepInput
from pdflow.worker import stage_runner
from pdflow.worker.stage_runner import StageRunner

BLOCK, PAGES, PAGE, H_Q, H_KV, D = 16, 2, 8, 4, 2, 16


def verify_step(q_lens: list[int], starts: list[int]) -> StepInput:
    ids, pos, slots, cu, ctx, tables = [], [], [], [0], [], []
    for seq, (n, start) in enumerate(zip(q_lens, starts, strict=True)):
        table = [seq * 4 + b for b in range(4)]
        ids += [5] * n
        pos += list(range(start, start + n))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        cu.append(cu[-1] + n)
        ctx.append(start + n)
        tables.append(table)
    return StepInput(step=0, seq_ids=[f"s{i}" for i in range(len(q_lens))], token_ids=ids, positions=pos,
                     slot_mapping=slots, cu_seqlens_q=cu, context_lens=ctx, block_tables=tables,
                     sample_rows=[], sample_seq_ids=[], sampling=[SamplingSpec()])


@pytest.mark.parametrize(("q_lens", "starts"), [
    ([8], [37]), ([8, 8, 8], [37, 3, 50]), ([1, 5, 8, 3], [37, 3, 50, 20]),
    ([28], [30]),  # a prefix-hit tail: longer than ROWS_AS_DECODE, a short step in all
    ([1, 17, 2], [40, 3, 50]),
])
def test_short_query_rows_attend_like_the_prefill_op(q_lens, starts, monkeypatch):
    gen = torch.Generator().manual_seed(len(q_lens))
    step = verify_step(q_lens, starts=starts)
    runner = StageRunner(model=None, device=torch.device("cpu"))
    rows = runner._rows_as_decode(step, q_lens)  # what a GPU runner takes (the CPU: verifies only)
    assert rows.decode_only and rows.context_lens.shape[0] == sum(q_lens)
    monkeypatch.setattr(stage_runner, "ROWS_AS_DECODE", 0)  # the prefill op's metadata
    monkeypatch.setattr(stage_runner, "SHORT_STEP_ROWS", 0)
    _, _, chunk = runner.tensors(step)
    assert not chunk.decode_only

    shape = (4 * len(q_lens), PAGES, H_KV, PAGE, D)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(sum(q_lens), H_Q, D, generator=gen)
    backend = get_backend("torch")
    want = backend.prefill_attention(q, k_cache, v_cache, chunk.cu_seqlens_q, chunk.context_lens,
                                     chunk.block_tables, 0.25, max_seqlen_q=chunk.max_seqlen_q)
    got = backend.decode_attention(q, k_cache, v_cache, rows.context_lens, rows.block_tables, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # One more token of context per row (a non-causal verify) is not the same attention.
    leaky = backend.decode_attention(q, k_cache, v_cache, rows.context_lens + 1, rows.block_tables, 0.25)
    assert not torch.allclose(leaky, want, atol=1e-3)


def test_which_steps_run_as_decode_rows():
    rows = stage_runner.runs_as_decode_rows
    assert not rows([]) and not rows([1, 1, 1])  # plain decode: the decode op already
    assert rows([8] * 64)  # a verify at batch 64: 512 rows, each sequence short
    assert rows([100]) and rows([60, 60, 1])  # a short step in all
    assert not rows([129]) and not rows([100, 100])  # a real prefill chunk keeps its tiles
    # On the CPU only verifies do: the prefill op reads each context once, rows re-read it
    assert rows([8] * 64, short_steps=False) and not rows([100], short_steps=False)
    assert not rows([60, 60, 1], short_steps=False)


def test_a_cpu_runner_takes_a_short_chunk_as_a_prefill():
    """The stage runner decides by its device: the same 28-token tail is decode rows on
    a GPU (a prefill tile would walk the context alone) and one prefill on the CPU."""
    step = verify_step([28], starts=[30])
    _, _, cpu = StageRunner(model=None, device=torch.device("cpu")).tensors(step)
    assert not cpu.decode_only and cpu.max_seqlen_q == 28
    _, _, verify = StageRunner(model=None, device=torch.device("cpu")).tensors(verify_step([8], starts=[37]))
    assert verify.decode_only


def test_decode_graphs_take_a_verify_as_rows():
    from pdflow.worker.stage import MAX_GRAPH_ROWS, decode_graph_rows

    assert decode_graph_rows(256, 0, 2048) == 256  # no drafts: one row per sequence
    assert decode_graph_rows(1, 7, 2048) == 8  # batch 1 verifies [anchor, 7 drafts]
    assert decode_graph_rows(64, 7, 2048) == 512
    assert decode_graph_rows(256, 7, 2048) == MAX_GRAPH_ROWS  # larger verifies run eagerly
    assert decode_graph_rows(16, 7, 64) == 64  # never past the step's token budget
    assert decode_graph_rows(600, 7, 8192) == 600  # nor below one row per sequence
