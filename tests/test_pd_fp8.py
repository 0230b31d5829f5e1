"""fp8 KV through P/D: the default deployment's PP4 -> TP4 with DSpark and
``model.kv_dtype=fp8_e4m3`` over Mooncake TCP. Greedy tokens equal one process's fp8 run
(quantization is per token-head, so it does not depend on the layout), the producer's
transfer counter moves exactly the plan's bytes per block, and a wrong scale cut (each
head's values shipped with a neighbouring head's scales) changes the tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdflow import Deployment, SamplingParams, compose
from pdflow.graph import build_graph

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL = ["model.kv_dtype=fp8_e4m3", "prefill.block_size=32", "decode.block_size=32",
         "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16", "prefill.num_kv_blocks=24",
         "decode.num_kv_blocks=24", "prefill.max_num_batched_tokens=64", "decode.max_num_batched_tokens=64"]
PD = ["prefill=pp4", "decode=tp4", "drafter=dspark"]


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (5, 70, 96)]


def _run(overrides):
    spec = compose([*SMALL, *overrides])
    with Deployment(spec) as d:
        outs = d.generate(_prompts(), GREEDY)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        moved = (d.producer.kv_bytes_sent, d.producer.kv_blocks_sent) if d.producer is not None else None
        return [o.token_ids for o in outs], moved, spec


@pytest.fixture(scope="module")
def one_process():
    return _run(["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=none"])[0]


def test_fp8_pd_pp4_to_tp4_dspark_equals_one_process_and_moves_the_plans_bytes(one_process):
    tokens, (nbytes, blocks), spec = _run(PD)
    assert tokens == one_process
    per_block = build_graph(spec).transfer_bytes_per_block
    assert blocks == sum(-(-n // 32) for n in (5, 70, 96)) and nbytes == blocks * per_block


def test_a_wrong_scale_cut_changes_the_tokens(one_process):
    tokens, _, _ = _run([*PD, "transfer.force_wrong_scale_cut=true"])
    assert tokens != one_process


def test_served_metrics_count_the_plans_bytes_per_transferred_block():
    """``pdflow serve``'s split server (engine core process): after prompts land,
    /metrics' transfer bytes over blocks is the plan's bytes per transferred block."""
    import re

    import httpx

    from pdflow.serve.launch import serve_spec

    spec = compose([*SMALL, *PD, "tracking.enabled=false"])
    with serve_spec(spec, port=0) as served:
        for prompt in ("Question: Mira has 12 apples.", "Once upon a time " * 8):
            body = {"model": served.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        text = httpx.get(f"{served.url}/metrics", timeout=30).text
    nbytes = float(re.search(r"^pdflow_kv_transfer_bytes_total (\S+)$", text, re.M).group(1))
    blocks = float(re.search(r"^pdflow_kv_transfer_blocks_total (\S+)$", text, re.M).group(1))
    assert blocks >= 2 and nbytes == blocks * build_graph(spec).transfer_bytes_per_block
