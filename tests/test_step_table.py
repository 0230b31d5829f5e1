"""The profile's model step table: interpolation against hand-computed cases, the
estimate pricing a stage from it (layers x layer time of the side's own TP shard + head
+ overheads), an older profile without a table still loading and pricing by the GEMM
model, and a real (short) timing of the tiny model's layer."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
from estimate_kit import flat_shard, tiny_profile

from pdflow.bench import estimate as estimate_mod
from pdflow.bench.estimate import Pricer
from pdflow.bench.profile import MachineProfile, _timed
from pdflow.bench.step_table import ShardTimes, StepTable, decode_at, geometry_of, interpolate
from pdflow.graph import CONSUMER, PRODUCER, build_graph
from pdflow.spec.load import compose_spec


def test_interpolation_is_log_log_between_points_floor_below_linear_above():
    points = {16: 1.0, 64: 4.0, 256: 8.0}
    assert interpolate(points, 16) == 1.0 and interpolate(points, 64) == 4.0
    # 32 is halfway between 16 and 64 in log: sqrt(1 * 4) = 2
    assert interpolate(points, 32) == pytest.approx(2.0)
    # 128 halfway between 64 and 256 in log: sqrt(4 * 8)
    assert interpolate(points, 128) == pytest.approx(math.sqrt(32.0))
    assert interpolate(points, 4) == 1.0  # below: the smallest point's time
    assert interpolate(points, 1024) == pytest.approx(8.0 * 1024 / 256)  # above: scaled by tokens
    with pytest.raises(ValueError):
        interpolate({}, 3)


def test_decode_is_interpolated_by_batch_then_linear_in_context():
    table = {64: {1: 1.0, 4: 4.0}, 512: {1: 3.0, 4: 6.0}}
    assert decode_at(table, 2, 64) == pytest.approx(2.0)  # log-log: sqrt(1 * 4)
    assert decode_at(table, 1, 288) == pytest.approx(2.0)  # halfway in context: (1 + 3) / 2
    assert decode_at(table, 1, 10) == 1.0  # shorter than measured: the shortest's
    assert decode_at(table, 1, 960) == pytest.approx(5.0)  # longer: the line extended (slope 2/448)
    assert decode_at({64: {1: 2.0}, 512: {1: 1.0}}, 1, 960) == 1.0  # a falling (noisy) pair: no lower


def _graph(*overrides: str):
    return build_graph(compose_spec(["drafter=none", *overrides]))


def test_a_one_rank_step_is_layers_times_the_shards_layer_plus_head_and_overhead():
    pricer = Pricer(graph=_graph("mode=monolithic", "decode=tp1"), profile=tiny_profile(), role=CONSUMER)
    # 8 layers of the tp1 / 2-thread shard, its head, the overhead measured against the table
    assert pricer.step_s(4, 100, 4) == pytest.approx(0.01 + 8 * 1e-3 + 5e-4)
    # a 128-token prefill of one prompt: dense 0.5 ms + one row's attention 0.5 ms a layer
    alone, _ = pricer.prefill(128)
    assert alone == pytest.approx(0.01 + 8 * 1e-3 + 5e-4)


def test_a_prefill_step_prices_each_rows_attention_over_its_own_prompt():
    counts = (16, 64, 256, 1024, 2048)
    shard = ShardTimes(tp=1, threads=2, dense_s={t: t * 1e-6 for t in counts},
                       prefill_attention_s={t: t * t * 1e-9 for t in counts}, decode_s={64: {1: 1e-3}},
                       head_s={1: 1e-4})
    # 512 tokens as 4 prompts of 128: dense at 512, 4 x attention at 128 (log-log on t^2 is exact)
    assert shard.layer_s(512, 4, 65) == pytest.approx(512e-6 + 4 * 128 * 128 * 1e-9)
    assert shard.layer_s(512, 1, 257) == pytest.approx(512e-6 + 512 * 512 * 1e-9)


def test_tp_and_pp_sides_use_their_own_shard_and_layer_count():
    prof = tiny_profile()
    tp2 = Pricer(graph=_graph("mode=monolithic", "decode=tp2"), profile=prof, role=CONSUMER)
    all_reduce = 2 * 8 * (5e-4 + 4 * 256 * 4 / 1e9)
    # tp2: one thread a rank, the tp2 shard's layer; a rank message and one stage's rank work
    assert tp2.step_s(4, 100, 4) == pytest.approx(0.01 + 2e-4 + 2e-3 + 8 * 3e-3 + 7e-4 + all_reduce)
    pp2 = Pricer(graph=_graph("mode=monolithic", "decode=tp1", "decode.pp=2"), profile=prof, role=CONSUMER)
    stages = pp2.stage_times(4, 100, 4)  # 4 layers each of the tp1 / 1-thread shard; the head on the last
    assert stages == pytest.approx([4 * 2e-3, 4 * 2e-3 + 6e-4])
    tp4 = Pricer(graph=_graph("mode=monolithic", "decode=tp4"), profile=prof, role=CONSUMER)
    assert tp4.stage_times(4, 100, 4) == pytest.approx([2 * (8 * 4e-3 + 8e-4) + all_reduce])  # 4 ranks, 2 cores
    pd = Pricer(graph=_graph("prefill=pp2", "decode=tp2"), profile=prof, role=PRODUCER)
    assert pd.stage_times(4, 100, 4) == pytest.approx([4 * 2e-3, 4 * 2e-3 + 6e-4])


def test_the_served_request_cost_adds_to_ttft_and_to_each_row_of_a_prefill_step():
    pricer = Pricer(graph=_graph("mode=monolithic", "decode=tp1"), profile=tiny_profile(request_overhead_s=0.02),
                    role=CONSUMER)
    step = 0.01 + 8 * 1e-3 + 5e-4
    alone, tok_s = pricer.prefill(128, concurrent=4)
    assert alone == pytest.approx(0.02 + step)
    batched = 0.01 + 8 * (0.5e-3 + 4 * 0.5e-3) + 5e-4  # 4 prompts of 128: dense once, attention per prompt
    assert tok_s == pytest.approx(512 / (batched + 4 * 0.02))
    # and the part that grows with the prompt: 128 tokens x 0.1 ms on every request
    grows = Pricer(graph=_graph("mode=monolithic", "decode=tp1"), role=CONSUMER,
                   profile=tiny_profile(request_overhead_s=0.02, request_overhead_per_token_s=1e-4))
    alone, tok_s = grows.prefill(128, concurrent=4)
    assert alone == pytest.approx(0.02 + 0.0128 + step)
    assert tok_s == pytest.approx(512 / (batched + 4 * (0.02 + 0.0128)))


def test_a_table_for_another_model_or_thread_count_falls_back_to_the_gemm_model(capsys):
    estimate_mod._SAID.clear()
    prof = tiny_profile()
    other = Pricer(graph=_graph("model=qwen3-0.6b", "model.path=null", "mode=monolithic", "decode=tp1"), profile=prof,
                   role=CONSUMER)
    assert other.shard() is None
    assert "no step table for qwen3-0.6b" in capsys.readouterr().err
    prof.step_tables[0].shards = prof.step_tables[0].shards[1:]  # tp1 at 2 threads not measured
    assert Pricer(graph=_graph("mode=monolithic", "decode=tp1"), profile=prof, role=CONSUMER).shard() is None


def test_the_table_survives_save_and_load(tmp_path):
    prof = tiny_profile()
    loaded = MachineProfile.load(prof.save(tmp_path / "p.json"))
    assert loaded == prof and loaded.step_tables[0].shards[2].decode_s[512][16] == 3e-3


def test_an_old_profile_without_a_table_loads_and_prices_by_the_gemm_rate_said_once(tmp_path, capsys):
    raw = asdict(tiny_profile())
    for key in ("version", "step_tables", "table_step_overhead_s", "table_rank_step_overhead_s",
                "request_overhead_s"):
        del raw[key]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    old = MachineProfile.load(tmp_path / "old.json")
    assert old.version == 1 and old.step_tables == [] and old.request_overhead_s == 0.0
    estimate_mod._SAID.clear()
    pricer = Pricer(graph=_graph("mode=monolithic", "decode=tp1"), profile=old, role=CONSUMER)
    matmul = 256 * 64 * (8 * 2 + 4 * 2) + 3 * 256 * 768
    flops = 2 * 4 * matmul * 8 + 4 * 8 * 64 * 4 * 100 * 8 + 2 * 4 * 128 * 256
    assert pricer.step_s(4, 100, 4) == pytest.approx(0.5 + flops / 1e9)  # the old overhead, the GEMM rate
    pricer.step_s(1, 10, 1)
    assert capsys.readouterr().err.count("no step table (an older file)") == 1


def test_the_tiny_models_layer_is_timed_per_shard():
    """The real model code on this CPU, one quick round a point (no time is asserted)."""
    from pdflow.bench.step_timing import measure_step_table

    def quick(fn, *, sync, min_s, rounds):
        return _timed(fn, sync=sync, min_s=0.001, rounds=1)

    table = measure_step_table(["model=tiny"], "cpu", (2,), 2, quick)
    assert table.model == "tiny" and table.geometry["hidden"] == 256
    (shard,) = table.shards
    assert (shard.tp, shard.threads) == (2, 1)
    assert set(shard.dense_s) == {16, 64, 256, 1024, 2048} and set(shard.decode_s) == {32, 512}
    values = [*shard.dense_s.values(), *shard.prefill_attention_s.values(), *shard.head_s.values(),
              *(v for row in shard.decode_s.values() for v in row.values())]
    assert all(v > 0 for v in values)


def test_serving_costs_are_what_the_probes_took_beyond_the_table():
    """Hand-computed from the table above; and priced back, the profile reproduces the
    served steps it was measured on (the decomposition adds up)."""
    from pdflow.bench.profile import ServedProbe
    from pdflow.bench.served_costs import table_overheads

    prof = tiny_profile()
    one = ServedProbe(step_s=0.02, ttft_s=0.05, batch=4, batch_step_s=0.035, prompt_tokens=4, context=28)
    two = ServedProbe(step_s=0.06, ttft_s=0.09, prompt_tokens=4, context=28)
    step, row, rank, request, per_token = table_overheads(prof.step_tables[0], 2, 8, one, two, 5e-4, 2e-4)
    assert per_token == 0.0  # no long-prompt rounds
    assert step == pytest.approx(0.02 - (8 * 1e-3 + 5e-4))
    assert row == pytest.approx((0.035 - step - (8 * 1e-3 + 5e-4)) / 3)  # 4 streams: 3 rows beyond the first
    assert request == pytest.approx(0.05 - step - (8 * 1e-3 + 5e-4))  # 4 prompt tokens: the batch-4 decode row
    assert rank == pytest.approx(0.06 - step - 2e-4 - 2 * 8 * 5e-4 - (8 * 3e-3 + 7e-4))
    priced = tiny_profile(table_step_overhead_s=step, table_rank_step_overhead_s=rank, table_row_overhead_s=row)
    tp1 = Pricer(graph=_graph("mode=monolithic", "decode=tp1"), profile=priced, role=CONSUMER)
    assert tp1.step_s(1, 28, 1) == pytest.approx(0.02) and tp1.step_s(4, 28, 4) == pytest.approx(0.035)
    tp2 = Pricer(graph=_graph("mode=monolithic", "decode=tp2"), profile=priced, role=CONSUMER)
    assert tp2.step_s(1, 28, 1) == pytest.approx(0.06, abs=1e-4)  # + the activations over the link
    assert tp2.step_s(4, 28, 4) == pytest.approx(0.06, abs=1e-4)  # rank processes: rows overlap their compute
    # TP4 on 2 cores: the step measured as served, not TP2's rank work doubled by the crowd rule
    crowded = Pricer(graph=_graph("mode=monolithic", "decode=tp4"), profile=priced, role=CONSUMER)
    assert crowded.step_s(1, 28, 1) == pytest.approx(step + 2e-4 + 2 * rank + 2 * 8 * 5e-4 + 2 * (8 * 4e-3 + 8e-4),
                                                     abs=2e-4)
    together = ServedProbe(step_s=0.02, ttft_s=0.05, batch=4, batch_step_s=0.035, batch_ttft_s=0.12,
                           prompt_tokens=4, context=28)
    # 4 one-token requests at once: the batch step's compute (16 tokens over 4 rows: the decode
    # row), the step and 3 rows' cost, the rest split 4 ways
    assert table_overheads(prof.step_tables[0], 2, 8, together, two, 5e-4, 2e-4)[3] == pytest.approx(
        (0.12 - step - 3 * row - (8 * 1e-3 + 5e-4)) / 4)
    together_long = ServedProbe(step_s=0.02, ttft_s=0.05, batch=4, batch_step_s=0.035, batch_ttft_s=0.12,
                                prompt_tokens=4, context=28, long_prompt_tokens=128, batch_long_ttft_s=0.3)
    # 4 prompts of 128: dense at 512 tokens + 4 prompts' attention at 128, a layer, 8 layers + head
    got = table_overheads(prof.step_tables[0], 2, 8, together_long, two, 5e-4, 2e-4)
    short = (0.12 - step - 3 * row - (8 * 1e-3 + 5e-4)) / 4
    long = (0.3 - step - 3 * row - (8 * (5e-4 + 4 * 5e-4) + 5e-4)) / 4
    assert got[3] == pytest.approx(short) and got[4] == pytest.approx((long - short) / 124)
    # with rank processes both streams' medians measure the step: their mean (0.07 and 0.05: 0.06)
    both = ServedProbe(step_s=0.07, ttft_s=0.09, batch=4, batch_step_s=0.05, prompt_tokens=4, context=28)
    assert table_overheads(prof.step_tables[0], 2, 8, one, both, 5e-4, 2e-4)[2] == pytest.approx(rank)


def test_gpu_points_stop_at_the_models_positions():
    """The GPU table's 8192-token prefill point is past the tiny model's 4096 positions:
    timing it read RoPE's table out of bounds on the H200 (an illegal memory access)."""
    from pdflow.bench.step_timing import GPU_POINTS, points_within

    tiny = points_within(GPU_POINTS, 4096)
    assert max(tiny["prefill"]) <= 4096 and max(tiny["contexts"]) <= 4096
    assert tiny["batches"] == GPU_POINTS["batches"]
    assert points_within(GPU_POINTS, 40960) == GPU_POINTS
    assert points_within({"prefill": (8192,), "batches": (1,), "contexts": (8192,)}, 4096)["prefill"] == (4096,)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_the_tiny_models_layer_is_timed_graphed_on_a_gpu():
    """The graphed pieces replay over tensors their capture closed over: freed early, the
    replayed KV write used slots overwritten by other tensors (an illegal address)."""
    import torch

    from pdflow.bench.step_timing import measure_step_table

    def quick(fn, *, sync, min_s, rounds):
        return _timed(fn, sync=sync, min_s=0.001, rounds=1)

    table = measure_step_table(["model=tiny"], "cuda", (1,), 1, quick)
    torch.cuda.synchronize()
    (shard,) = table.shards
    assert all(v > 0 for v in [*shard.dense_s.values(), *shard.head_s.values()])
    assert all(v >= 0 for v in shard.prefill_attention_s.values())


def _cuda_profile(layer: float, **kw):
    model = compose_spec(["model=tiny"]).model
    table = StepTable(model="tiny", geometry=geometry_of(model, "cuda"), shards=[flat_shard(1, 16, layer, 5e-4)])
    return tiny_profile(device="cuda", cores=16, step_tables=[table], table_row_overhead_s=1e-3,
                        transfer_latency_s={"nccl": 1e-5}, transfer_bytes_s={"nccl": 1e11}, **kw)


def test_an_overlapped_gpu_side_prices_a_stream_of_steps_at_the_larger_of_host_and_device():
    """Overlap scheduling (a one-rank CUDA side without a drafter) builds step N+1 while
    the device runs step N: a stream of steps costs the larger of the two, a lone step
    both. Summed, a Qwen3-0.6B decode on one H200 was priced at 0.59x served."""
    cuda = ("mode=monolithic", "decode=tp1", "decode.device=cuda", "prefill.device=cuda")
    host = 0.01 + 3 * 1e-3  # the step overhead and three rows beyond the first
    light = Pricer(graph=_graph(*cuda), profile=_cuda_profile(1e-3), role=CONSUMER)
    assert light.overlapped()
    device = 8 * 1e-3 + 5e-4
    assert light.step_s(4, 100, 4, stream=True) == pytest.approx(host)  # host-bound
    assert light.step_s(4, 100, 4) == pytest.approx(host + device)  # alone: both
    heavy = Pricer(graph=_graph(*cuda), profile=_cuda_profile(5e-3), role=CONSUMER)
    assert heavy.step_s(4, 100, 4, stream=True) == pytest.approx(8 * 5e-3 + 5e-4)  # device-bound
    off = Pricer(graph=_graph(*cuda, "decode.overlap_scheduling=false"), profile=_cuda_profile(1e-3), role=CONSUMER)
    assert not off.overlapped() and off.step_s(4, 100, 4, stream=True) == pytest.approx(host + device)
    # prefill at load: four 128-token prompts a step, their requests' host work beside the step's
    served = Pricer(graph=_graph(*cuda), profile=_cuda_profile(1e-3, request_overhead_s=2e-3), role=CONSUMER)
    _, tok_s = served.prefill(128, 4)
    assert tok_s == pytest.approx(512 / max(host + 4 * 2e-3, device))
