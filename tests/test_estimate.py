"""The plan-time estimate's arithmetic against hand-computed cases (tiny model: 8 layers,
hidden 256, 8 heads of 64, 4 KV heads, MLP 768, vocab 128, fp32), priced with a
profile of round numbers; and ``pdflow plan --estimate``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdflow.bench.estimate import EstimateError, Pricer, estimate, transfer_s
from pdflow.bench.profile import MachineProfile
from pdflow.graph import CONSUMER, PRODUCER, build_graph
from pdflow.spec import SloSpec
from pdflow.spec.load import compose_spec

MATMUL = 256 * 64 * (8 * 2 + 4 * 2) + 3 * 256 * 768  # per layer: q, k, v, o; gate, up, down = 983040


def _profile(**kw) -> MachineProfile:
    base = dict(device="cpu", host="test", cores=1, gemm_flops_s=1e9, gemm_flops_s_one_thread=1e9,
                mem_bytes_s=1e15, host_copy_bytes_s=1e9, transfer_bytes_s={"mooncake": 1e9, "gloo": 1e9},
                transfer_latency_s={"mooncake": 1e-3, "gloo": 1e-4}, rank_message_s=2e-4, step_overhead_s=0.01)
    return MachineProfile(**(base | kw))


def _graph(*overrides: str):
    return build_graph(compose_spec(["drafter=none", *overrides]))


def test_one_rank_prefill_and_decode_steps_by_hand():
    graph = _graph("mode=monolithic", "decode=tp1")
    pricer = Pricer(graph=graph, profile=_profile(), role=CONSUMER)
    # 128 prompt tokens, mean context 65, one sampled row: matmuls, causal attention, LM head.
    flops = 2 * 128 * MATMUL * 8 + 4 * 8 * 64 * 128 * 65 * 8 + 2 * 1 * 128 * 256
    alone, _ = pricer.prefill(128)
    assert alone == pytest.approx(0.01 + flops / 1e9)
    # A decode step of 4 sequences at context 100: 4 rows through everything.
    flops = 2 * 4 * MATMUL * 8 + 4 * 8 * 64 * 4 * 100 * 8 + 2 * 4 * 128 * 256
    assert pricer.step_s(4, 100, 4) == pytest.approx(0.01 + flops / 1e9)


def test_tensor_parallel_splits_the_flops_and_pays_two_all_reduces_per_layer():
    graph = _graph("mode=monolithic", "decode=tp2")
    pricer = Pricer(graph=graph, profile=_profile(cores=2, gemm_flops_s=2e9), role=CONSUMER)
    flops = (2 * 4 * MATMUL * 8 + 4 * 8 * 64 * 4 * 100 * 8) / 2 + 2 * 4 * 128 * 256
    all_reduce = 2 * 8 * (1e-4 + 4 * 256 * 4 / 1e9)  # latency + 4 rows of hidden fp32 at gloo's rate
    # one rank's threads: cores // world = 1, so one thread's rate
    assert pricer.step_s(4, 100, 4) == pytest.approx(0.01 + 2e-4 + flops / 1e9 + all_reduce)


def test_pipeline_stages_add_up_and_hop():
    graph = _graph("mode=monolithic", "decode=tp1", "decode.pp=2")
    pricer = Pricer(graph=graph, profile=_profile(cores=2, gemm_flops_s=2e9), role=CONSUMER)
    per_stage = [2 * 4 * MATMUL * 4 + 4 * 8 * 64 * 4 * 100 * 4, 2 * 4 * MATMUL * 4 + 4 * 8 * 64 * 4 * 100 * 4
                 + 2 * 4 * 128 * 256]
    assert pricer.step_s(4, 100, 4) == pytest.approx(0.01 + 2e-4 + 1e-4 + sum(per_stage) / 1e9)


def test_measured_collectives_and_rank_step_work_price_a_multi_process_side():
    prof = _profile(cores=2, gemm_flops_s=2e9, allreduce_s=5e-4, hop_s=3e-4, rank_step_overhead_s=2e-3)
    tp2 = Pricer(graph=_graph("mode=monolithic", "decode=tp2"), profile=prof, role=CONSUMER)
    flops = (2 * 4 * MATMUL * 8 + 4 * 8 * 64 * 4 * 100 * 8) / 2 + 2 * 4 * 128 * 256
    all_reduce = 2 * 8 * (5e-4 + 4 * 256 * 4 / 1e9)
    assert tp2.step_s(4, 100, 4) == pytest.approx(0.01 + 2e-4 + 2e-3 + flops / 1e9 + all_reduce)
    pp2 = Pricer(graph=_graph("mode=monolithic", "decode=tp1", "decode.pp=2"), profile=prof, role=CONSUMER)
    flops = 2 * 4 * MATMUL * 8 + 4 * 8 * 64 * 4 * 100 * 8 + 2 * 4 * 128 * 256
    assert pp2.step_s(4, 100, 4) == pytest.approx(0.01 + 2e-4 + 2 * 2e-3 + 3e-4 + flops / 1e9)


def test_cpu_ranks_beyond_the_cores_take_turns():
    """TP4 on two cores: each rank one thread (half the machine's rate), two ranks per
    core, so the stage's compute and the ranks' own step work both take twice as long."""
    prof = _profile(cores=2, gemm_flops_s=2e9, allreduce_s=5e-4, rank_step_overhead_s=2e-3)
    tp4 = Pricer(graph=_graph("mode=monolithic", "decode=tp4"), profile=prof, role=CONSUMER)
    flops = (2 * 4 * MATMUL * 8 + 4 * 8 * 64 * 4 * 100 * 8) / 4 + 2 * 4 * 128 * 256
    all_reduce = 2 * 8 * (5e-4 + 4 * 256 * 4 / 1e9)
    assert tp4.step_s(4, 100, 4) == pytest.approx(0.01 + 2e-4 + 2 * 2e-3 + 2 * flops / 1e9 + all_reduce)


def test_transfer_time_is_the_busiest_producer_ranks_bytes():
    graph = _graph("prefill=tp1", "decode=tp1")
    # one producer rank writes every layer's K and V: 8 * 2 * 4 heads * 64 * 128 tokens * 4 bytes
    per_block = 8 * 2 * 4 * 64 * 128 * 4
    assert transfer_s(graph, _profile(), 300) == pytest.approx(1e-3 + 3 * per_block / 1e9)
    graph = _graph("prefill=tp2", "decode=tp2")
    assert transfer_s(graph, _profile(), 300) == pytest.approx(1e-3 + 3 * per_block / 2 / 1e9)


def test_goodput_is_refused_by_an_unreachable_ttft_and_counts_devices():
    graph = _graph("prefill=tp2", "decode=tp2")
    est = estimate(graph, _profile(), slo=SloSpec(ttft_s=1e-3), input_len=128, output_len=16)
    assert est.goodput_req_s == 0 and "TTFT" in est.limits[0]
    est = estimate(graph, _profile(), slo=SloSpec(ttft_s=60.0), input_len=128, output_len=16)
    assert est.devices == 4 and est.goodput_req_s > 0
    assert est.goodput_per_device == pytest.approx(est.goodput_req_s / 4)
    assert est.pool_blocks == {PRODUCER: graph.budgets[PRODUCER].pool_blocks, CONSUMER: graph.budgets[CONSUMER].pool_blocks}


def test_monolithic_goodput_serves_prefill_and_decode_in_series():
    graph = _graph("mode=monolithic", "decode=tp1", "decode.max_num_seqs=1")
    prof = _profile()
    est = estimate(graph, prof, slo=SloSpec(ttft_s=60.0), input_len=128, output_len=16)
    pricer = Pricer(graph=graph, profile=prof, role=CONSUMER)
    _, tok_s = pricer.prefill(128)
    tpot = pricer.step_s(1, 128 + 8, 1)
    expected = 0.8 / (128 / tok_s + 16 * tpot)  # one at a time: prefill, then 16 steps; headroom 0.8
    assert est.decode_batch == 1 and est.goodput_req_s == pytest.approx(expected)


def test_a_cpu_profile_refuses_to_price_a_gpu_graph():
    graph = _graph("mode=monolithic", "decode=tp1", "decode.device=cuda")
    with pytest.raises(EstimateError, match="pdflow profile --device cuda"):
        estimate(graph, _profile())


def test_plan_estimate_prints_the_tables(tmp_path):
    path = _profile().save(tmp_path / "profile.json")
    out = subprocess.run([sys.executable, "-m", "pdflow.cli", "plan", "--json", "--estimate", "--profile", str(path),
                          "prefill=tp2", "decode=tp2", "drafter=none"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    est = json.loads(out.stdout[out.stdout.rindex('{\n "estimate"'):])["estimate"]
    assert est["devices"] == 4 and est["pool_blocks"]["decode"] > 0
    missing = subprocess.run([sys.executable, "-m", "pdflow.cli", "plan", "--estimate", "--profile",
                              str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "pdflow profile" in missing.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_profile_prices_a_gpu_graph():
    from pdflow.bench.profile import measure
    from pdflow.serve.step_probe import served_probe

    prof = measure("cuda", served_probe, models=("qwen3-0.6b",))
    assert prof.device == "cuda" and prof.gemm_flops_s > 1e13 and prof.mem_bytes_s > 1e11
    assert [t.model for t in prof.step_tables] == ["tiny", "qwen3-0.6b"]
    graph = _graph("model=qwen3-0.6b", "model.path=null", "mode=monolithic", "decode=tp1", "decode.device=cuda",
                   "prefill.device=cuda")
    assert Pricer(graph=graph, profile=prof, role=CONSUMER).shard() is not None  # priced by its step table
    est = estimate(graph, prof, input_len=512, output_len=64)
    assert est.prefill_tok_s[512] > 1e3 and est.decode_tok_s[1] > 10 and est.pool_blocks["decode"] > 0


def test_the_gemm_rate_is_taken_at_the_models_size():
    prof = _profile(gemm_flops_s=2e9, gemm_flops_s_by_dim={"256": 1e8, "4096": 1e9})
    assert prof.gemm_rate(300) == 1e8 and prof.gemm_rate(2048) == 1e9 and prof.gemm_rate(None) == 2e9
