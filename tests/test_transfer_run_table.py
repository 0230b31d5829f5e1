"""The GPU pack/scatter of ``transfer=nccl``: one ``copy_runs`` launch per chunk over a
slice of the request's ``RunTable`` rows must leave the bytes ``packing`` leaves (the path
the CPU pairs and the Mooncake staging run), chunk by chunk, under TRITON_INTERPRET on CPU
tensors; the direct cache-to-cache rows of ``transfer=cuda_ipc`` leave the caches
``packing`` leaves; and rows built for the wrong blocks, or a chunk's span off by a
block, are caught."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the kernel's decoration
    os.environ["TRITON_INTERPRET"] = "1"

import pdflow.kernels.copy_runs as copy_runs_mod  # noqa: E402
from transfer_kit import caches_for, producer_caches_of  # noqa: E402

from pdflow.graph import CONSUMER  # noqa: E402
from pdflow.transfer import run_table  # noqa: E402
from pdflow.transfer.p2p import chunks  # noqa: E402
from pdflow.transfer.p2p_parts import copy_chunk  # noqa: E402
from pdflow.transfer.packing import packed_nbytes, pieces  # noqa: E402
from pdflow.transfer.run_table import RunTable, direct_rows  # noqa: E402

if not torch.cuda.is_available():  # imported earlier by another module, compiled for a GPU
    copy_runs_mod = importlib.reload(copy_runs_mod)

SRC, DST = [4, 0, 3], [1, 5, 2]
OVERRIDES = ["transfer=nccl", "prefill=pp2", "decode=tp2", "drafter=dspark", "prefill.block_size=32",
             "decode.block_size=32"]


def pack(plan, caches, blocks, out, dst_bytes) -> None:
    """The oracle: the pairs' CPU pack (torch index ops per piece), the request as one chunk."""
    copy_chunk(pieces(plan, len(blocks)), out, blocks, plan=plan, caches=caches, other_block_bytes=dst_bytes,
               reverse=False)


def unpack(plan, packed, blocks, caches, src_bytes) -> None:
    copy_chunk(pieces(plan, len(blocks)), packed, blocks, plan=plan, caches=caches, other_block_bytes=src_bytes,
               reverse=True)


def _copy(kind: str, table: torch.Tensor, max_words: int, **how) -> None:
    if kind.startswith("triton"):
        if torch.cuda.is_available():
            pytest.skip("CPU tensors through the interpreter; on a GPU the transfer bench checks the kernel")
        # "triton-strided": three programs walk every slice (transfer.copy_programs)
        copy_runs_mod.copy_runs(table, max_words, programs=3 if kind == "triton-strided" else 0, **how)
    else:
        copy_runs_mod.copy_runs_reference(table, **how)


def _setup(graph_of, page: int):
    graph = graph_of(*OVERRIDES, f"prefill.kv_page_tokens={page}", f"decode.kv_page_tokens={page}")
    producers = producer_caches_of(graph, 6)
    # the last stage's cut to rank 1: target and draft units, two groups of runs
    cut = max((c for c in graph.cuts if c.consumer_rank == 1), key=lambda c: c.producer_rank)
    src_caches = producers[cut.producer_rank]
    plan = cut.over(set(src_caches))
    units = graph.rank(CONSUMER, cut.consumer_rank).units
    dst_bytes = {u.name: u.bytes_per_block for u in units}
    src_bytes = {n: c[0].numel() * c.element_size() for n, c in src_caches.items()}
    want = torch.empty(packed_nbytes(plan, len(SRC)), dtype=torch.uint8)
    pack(plan, src_caches, SRC, want, dst_bytes)
    want_caches = caches_for(units, 6, fill="poison")
    unpack(plan, want, DST, want_caches, src_bytes)
    return plan, units, src_caches, want, want_caches


@pytest.mark.parametrize("kind", ["triton", "triton-strided", "reference"])
@pytest.mark.parametrize("page", [16, 32])
def test_run_table_packs_and_scatters_like_packing(graph_of, kind, page):
    plan, units, src_caches, want, want_caches = _setup(graph_of, page)
    got_caches = caches_for(units, 6, fill="poison")
    packer = RunTable(plan, src_caches, "src")
    scatterer = RunTable(plan, got_caches, "dst")
    src_rows, dst_rows = packer.rows(SRC), scatterer.rows(DST)
    parts = chunks(plan, len(SRC), max(p.nbytes for p in chunks(plan, len(SRC), 1 << 30)[0]) // 2 or 1)
    assert len(parts) > 1  # several chunks, each packed and scattered on its own
    assert len({p.group for chunk in parts for p in chunk}) == len(plan.groups)  # page 32: two groups
    for chunk in parts:
        lo = chunk[0].offset
        hi = lo + sum(p.nbytes for p in chunk)
        buf = torch.zeros(hi - lo, dtype=torch.uint8)
        first, stop = packer.span(chunk, len(SRC))
        _copy(kind, src_rows[first:stop], packer.max_words, shift=buf.data_ptr() - lo)
        assert torch.equal(buf, want[lo:hi])
        first, stop = scatterer.span(chunk, len(DST))
        _copy(kind, dst_rows[first:stop], scatterer.max_words, shift=buf.data_ptr() - lo, reverse=True)
    for name, cache in want_caches.items():
        assert torch.equal(got_caches[name].view(torch.uint8), cache.view(torch.uint8)), name


def _copy_plan(kind: str, table: RunTable, blocks: list[int], first: int, stop: int, **how) -> None:
    """``copy_plan`` through the interpreter (rows computed in the kernel from the plan and
    the block ids), or the materialized rows through the reference."""
    if kind == "reference":
        copy_runs_mod.copy_runs_reference(table.rows(blocks)[first:stop], **how)
        return
    if torch.cuda.is_available():
        pytest.skip("CPU tensors through the interpreter; on a GPU the transfer bench checks the kernel")
    copy_runs_mod.copy_plan(table.plan, table.ids(blocks), len(blocks), first, stop, table.max_words,
                            programs=3 if kind == "triton-strided" else 0, **how)


@pytest.mark.parametrize("kind", ["triton", "triton-strided", "reference"])
@pytest.mark.parametrize("page", [16, 32])
def test_copy_plan_packs_and_scatters_like_packing(graph_of, kind, page):
    """The pairs' pack and scatter: every row computed in the kernel from the plan's
    per-group constants and the block ids, chunk by chunk, two groups at page 32."""
    plan, units, src_caches, want, want_caches = _setup(graph_of, page)
    got_caches = caches_for(units, 6, fill="poison")
    packer, scatterer = RunTable(plan, src_caches, "src"), RunTable(plan, got_caches, "dst")
    parts = chunks(plan, len(SRC), max(p.nbytes for p in chunks(plan, len(SRC), 1 << 30)[0]) // 2 or 1)
    assert len(parts) > 1 and len({p.group for chunk in parts for p in chunk}) == len(plan.groups)
    for chunk in parts:
        lo = chunk[0].offset
        buf = torch.zeros(sum(p.nbytes for p in chunk), dtype=torch.uint8)
        _copy_plan(kind, packer, SRC, *packer.span(chunk, len(SRC)), shift=buf.data_ptr() - lo)
        assert torch.equal(buf, want[lo:lo + len(buf)])
        _copy_plan(kind, scatterer, DST, *scatterer.span(chunk, len(DST)), shift=buf.data_ptr() - lo, reverse=True)
    for name, cache in want_caches.items():
        assert torch.equal(got_caches[name].view(torch.uint8), cache.view(torch.uint8)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("programs", [0, 3])
def test_copy_plan_on_a_gpu_leaves_packings_bytes_request_after_request(graph_of, programs):
    """Compiled on a GPU (one compile per kernel: a request's numbers are not specialized
    on), request after request of other lengths and blocks, packed then scattered chunk by
    chunk: each must leave exactly what ``packing`` leaves."""
    graph = graph_of(*OVERRIDES, "prefill.kv_page_tokens=32", "decode.kv_page_tokens=32")
    cut = max((c for c in graph.cuts if c.consumer_rank == 1), key=lambda c: c.producer_rank)
    src_cpu = producer_caches_of(graph, 12)[cut.producer_rank]
    plan = cut.over(set(src_cpu))
    units = graph.rank(CONSUMER, cut.consumer_rank).units
    dst_bytes = {u.name: u.bytes_per_block for u in units}
    src_bytes = {n: c[0].numel() * c.element_size() for n, c in src_cpu.items()}
    src = {n: c.cuda() for n, c in src_cpu.items()}
    got = {n: c.cuda() for n, c in caches_for(units, 12, fill="poison").items()}
    packer, scatterer = RunTable(plan, src, "src"), RunTable(plan, got, "dst")
    for src_blocks, dst_blocks in ((SRC, DST), ([7, 1], [11, 0]), (list(range(10, 0, -1)), list(range(10))),
                                   (SRC[::-1], [9, 8, 6])):
        want = torch.empty(packed_nbytes(plan, len(src_blocks)), dtype=torch.uint8)
        pack(plan, src_cpu, src_blocks, want, dst_bytes)
        want_caches = {n: c.cpu() for n, c in got.items()}
        unpack(plan, want, dst_blocks, want_caches, src_bytes)
        parts = chunks(plan, len(src_blocks), max(p.nbytes for p in chunks(plan, len(src_blocks), 1 << 30)[0]) // 2)
        for chunk in parts:
            lo = chunk[0].offset
            buf = torch.zeros(sum(p.nbytes for p in chunk), dtype=torch.uint8, device="cuda")
            copy_runs_mod.copy_plan(packer.plan, packer.ids(src_blocks), len(src_blocks),
                                    *packer.span(chunk, len(src_blocks)), packer.max_words,
                                    shift=buf.data_ptr() - lo, programs=programs)
            torch.cuda.synchronize()
            assert torch.equal(buf.cpu(), want[lo:lo + len(buf)]), (src_blocks, lo)
            copy_runs_mod.copy_plan(scatterer.plan, scatterer.ids(dst_blocks), len(dst_blocks),
                                    *scatterer.span(chunk, len(dst_blocks)), scatterer.max_words,
                                    shift=buf.data_ptr() - lo, reverse=True, programs=programs)
            torch.cuda.synchronize()
        for name, cache in want_caches.items():
            assert torch.equal(got[name].cpu().view(torch.uint8), cache.view(torch.uint8)), (name, src_blocks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter")
def test_copy_plan_reads_the_block_ids_when_it_runs(graph_of):
    """No addresses are built per request: the kernel reads the ids, so other blocks' ids
    move other blocks (caught against packing), and ids rewritten before the copy runs
    (the next request's) are the ones it moves: why a pair keeps one request in flight."""
    plan, _, src_caches, want, _ = _setup(graph_of, 16)
    table = RunTable(plan, src_caches, "src")
    n = len(table.rows(SRC))
    got = torch.zeros_like(want)
    copy_runs_mod.copy_plan(table.plan, table.ids(SRC[::-1]), len(SRC), 0, n, table.max_words, shift=got.data_ptr())
    assert not torch.equal(got, want)
    ids = table.ids(SRC[::-1])
    table.ids(SRC)  # rewritten in place before the copy runs
    got.zero_()
    copy_runs_mod.copy_plan(table.plan, ids, len(SRC), 0, n, table.max_words, shift=got.data_ptr())
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["triton", "triton-strided", "reference"])
def test_direct_rows_write_caches_like_packing(graph_of, kind):
    """transfer=cuda_ipc: producer caches straight into consumer caches, one launch."""
    plan, units, src_caches, _, want_caches = _setup(graph_of, 32)
    assert len(plan.groups) == 2  # target and draft runs differ in shape at page 32
    got_caches = caches_for(units, 6, fill="poison")
    rows = direct_rows(RunTable(plan, src_caches, "src"), SRC, RunTable(plan, got_caches, "dst"), DST)
    _copy(kind, rows, RunTable(plan, src_caches, "src").max_words)
    for name, cache in want_caches.items():
        assert torch.equal(got_caches[name].view(torch.uint8), cache.view(torch.uint8)), name


def test_a_span_off_by_a_block_is_caught(graph_of):
    """Each chunk's rows come from plan arithmetic, not a search: shifting a span by one
    block's runs must leave other bytes in the buffer."""
    plan, _, src_caches, want, _ = _setup(graph_of, 16)
    packer = RunTable(plan, src_caches, "src")
    rows = packer.rows(SRC)
    chunk = chunks(plan, len(SRC), max(p.nbytes for p in chunks(plan, len(SRC), 1 << 30)[0]) // 2 or 1)[1]
    lo, hi = chunk[0].offset, chunk[0].offset + sum(p.nbytes for p in chunk)
    first, stop = packer.span(chunk, len(SRC))
    runs = packer.groups[chunk[0].group].runs
    buf = torch.zeros(len(want), dtype=torch.uint8)  # the whole stream: a wrong span lands inside it
    copy_runs_mod.copy_runs_reference(rows[first:stop], shift=buf.data_ptr())
    assert torch.equal(buf[lo:hi], want[lo:hi])
    buf.zero_()
    shifted = rows[first + runs:stop + runs] if stop + runs <= len(rows) else rows[first - runs:stop - runs]
    copy_runs_mod.copy_runs_reference(shifted, shift=buf.data_ptr())
    assert not torch.equal(buf[lo:hi], want[lo:hi])


def test_a_table_for_other_blocks_is_caught(graph_of):
    graph = graph_of(*OVERRIDES, "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16")
    cut = graph.cuts[1]
    src_caches = producer_caches_of(graph, 6)[cut.producer_rank]
    plan = cut.over(set(src_caches))
    dst_bytes = {u.name: u.bytes_per_block for u in graph.rank(CONSUMER, cut.consumer_rank).units}
    want = torch.empty(packed_nbytes(plan, len(SRC)), dtype=torch.uint8)
    pack(plan, src_caches, SRC, want, dst_bytes)
    table = RunTable(plan, src_caches, "src")
    got = torch.zeros_like(want)
    copy_runs_mod.copy_runs_reference(table.rows(SRC[::-1]), shift=got.data_ptr())
    assert not torch.equal(got, want)
    copy_runs_mod.copy_runs_reference(table.rows(SRC), shift=got.data_ptr())
    assert torch.equal(got, want)


def test_rows_rewritten_per_request_follow_each_requests_blocks(graph_of):
    """A request's rows rewrite a per-length template: requests of other lengths in
    between, and a request of the same length with other blocks, leave the next table
    exactly its own."""
    graph = graph_of(*OVERRIDES, "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16")
    cut = graph.cuts[1]
    src_caches = producer_caches_of(graph, 12)[cut.producer_rank]
    plan = cut.over(set(src_caches))
    dst_bytes = {u.name: u.bytes_per_block for u in graph.rank(CONSUMER, cut.consumer_rank).units}
    table = RunTable(plan, src_caches, "src")
    many = [list(range(n))[::-1] for n in range(1, 12)]  # more lengths than the tables it keeps
    for blocks in (SRC, SRC[:1], SRC[::-1], SRC[1:], SRC, *many):
        want = torch.empty(packed_nbytes(plan, len(blocks)), dtype=torch.uint8)
        pack(plan, src_caches, blocks, want, dst_bytes)
        got = torch.zeros_like(want)
        copy_runs_mod.copy_runs_reference(table.rows(blocks), shift=got.data_ptr())
        assert torch.equal(got, want), blocks
    assert table._template.cache_info().currsize == run_table.TEMPLATES < 11  # device memory stays bounded


def test_the_word_size_agrees_with_the_kernel():
    assert run_table.WORD == copy_runs_mod.WORD


def test_importing_the_transfer_path_loads_no_triton():
    """Triton picks interpreter or compiler when triton.language is first imported: the
    transfer path (imported by every P/D engine) must leave that to the kernels' users."""
    import subprocess
    import sys

    code = ("import sys, pdflow.engine.deployment, pdflow.worker.kv_link, pdflow.transfer.p2p; "
            "sys.exit('triton.language' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
