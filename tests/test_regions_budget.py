"""Region map coverage under PP, and the block budget's reference-deployment shape."""

from __future__ import annotations

from collections import Counter

import pytest

from pdflow.graph.placement import layer_partition


@pytest.mark.parametrize("prefill", ["pp4", "pp4-uneven"])
def test_pp4_over_60_layers_covers_every_consumer_unit_once(graph_of, prefill):
    graph = graph_of("+experiment=ref_pp4_tp4_dspark", f"prefill={prefill}")
    assert graph.validate() == []
    parts = [len(s.layers) for s in graph.producer.stages]
    assert parts == ([15] * 4 if prefill == "pp4" else [16, 16, 16, 12])
    consumer_units = {u.name for r in graph.consumer.ranks for u in r.units}
    filled = Counter(r.consumer_unit for r in graph.regions)
    assert set(filled) == consumer_units
    assert set(filled.values()) == {1}
    # Stage-local layers are named by their global index: stage 1 exports layers 15.. / 16..
    stage1 = {u.layer for u in graph.producer.stages[1].ranks[0].units if u.family == "mha"}
    assert min(stage1) == parts[0] and max(stage1) == parts[0] + parts[1] - 1
    # Every consumer rank receives, from every stage, exactly that stage's layers.
    for cut in graph.cuts:
        stage = graph.producer.ranks[cut.producer_rank].stage
        layers = {
            int(dst.rsplit("_", 1)[1]) for g in cut.groups for _, dst in g.units if dst.startswith("mha")
        }
        assert layers == set(graph.producer.stages[stage].layers)


def test_taps_ride_to_the_last_stage(graph_of):
    graph = graph_of("+experiment=ref_pp4_tp4_dspark")
    stages = graph.producer.stages
    assert [s.taps_captured for s in stages] == [(3,), (17,), (31,), (45, 59)]
    assert graph.drafter.tap_stage == {3: 0, 17: 1, 31: 2, 45: 3, 59: 3}
    assert [s.taps_relayed for s in stages] == [(3,), (3, 17), (3, 17, 31), ()]
    assert stages[-1].holds_drafter and not any(s.holds_drafter for s in stages[:-1])
    assert graph.drafter.producer_proposes is False  # dspark writes context K/V apart


def test_block_budget_reproduces_the_reference_shape(graph_of, capsys):
    pools = {}
    for label, overrides in {
        "PP4 off": ["drafter=none"],
        "PP4 on": [],
        "PP4 16,16,16,12 on": ["prefill=pp4-uneven"],
        "TP4 off": ["prefill=tp4", "drafter=none"],
        "TP4 on": ["prefill=tp4"],
    }.items():
        graph = graph_of("+experiment=ref_pp4_tp4_dspark", *overrides)
        assert graph.validate() == []
        budget = graph.budgets["prefill"]
        pools[label] = budget
        per_block = [f"{s.bytes_per_block / 1e6:.2f}" for s in budget.stages]
        print(
            f"{label:22s} pool {budget.pool_blocks:>7,} blocks; MB/block per stage {per_block}; "
            f"binding stage {budget.binding_stage}"
        )
    with capsys.disabled():
        print("\n" + capsys.readouterr().out)
    off, on, uneven = pools["PP4 off"], pools["PP4 on"], pools["PP4 16,16,16,12 on"]
    # DSpark's layers sit on the last stage: its bytes per block grow and it binds the pool.
    assert on.stages[-1].bytes_per_block > off.stages[-1].bytes_per_block
    assert on.binding_stage == 3 and on.pool_blocks < off.pool_blocks
    # The drafter costs PP4 a larger share of blocks than it costs TP4.
    tp_off, tp_on = pools["TP4 off"], pools["TP4 on"]
    assert 1 - on.pool_blocks / off.pool_blocks > 1 - tp_on.pool_blocks / tp_off.pool_blocks
    # A lighter last stage wins back most of the blocks.
    assert on.pool_blocks < uneven.pool_blocks < off.pool_blocks
    assert uneven.pool_blocks - on.pool_blocks > (off.pool_blocks - on.pool_blocks) / 2


def test_partition_rules():
    from pdflow.spec import ParallelSpec

    assert layer_partition(60, ParallelSpec(pp=4, partition="lighter_last")) == [16, 16, 16, 12]
    assert layer_partition(8, ParallelSpec(pp=3)) == [3, 3, 2]
    assert layer_partition(8, ParallelSpec(pp=2, layer_partition=[5, 3])) == [5, 3]
