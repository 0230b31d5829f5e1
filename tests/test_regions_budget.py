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


def test_the_budget_leaves_room_for_the_transfer_pairs_buffers(graph_of):
    """Two-sided pairs hold a buffer per paired rank beside the KV pool: the budget
    subtracts what each rank holds, direct writes and monolithic runs hold none, and no
    consumer's pair ever allocates more than the graph counted for it."""
    from transfer_kit import caches_for, producer_caches_of

    from pdflow.graph import CONSUMER, PRODUCER
    from pdflow.graph.transfer_buffers import pair_buffer_bytes
    from pdflow.transfer.p2p import P2PListener

    layout = ["prefill=pp2", "decode=tp2", "drafter=dspark"]
    staged, direct = graph_of(*layout, "transfer=nccl"), graph_of(*layout, "transfer=mooncake_rdma")
    for role in (PRODUCER, CONSUMER):
        for stage, none in zip(staged.budgets[role].stages, direct.budgets[role].stages, strict=True):
            ranks = [r.rank for r in staged.instance(role).ranks if r.stage == stage.stage]
            held = max(sum(pair_buffer_bytes(staged.spec, c) for c in staged.cuts
                           if (c.producer_rank if role == PRODUCER else c.consumer_rank) == r) for r in ranks)
            assert stage.transfer_bytes == held > 0 and none.transfer_bytes == 0
            assert stage.blocks == (stage.usable_bytes - stage.weight_bytes - stage.activation_bytes
                                    - held) // stage.bytes_per_block < none.blocks
    assert all(s.transfer_bytes == 0 for s in graph_of(*layout, "mode=monolithic").budgets[CONSUMER].stages)
    on_gpus = graph_of(*layout, "transfer=cuda_ipc", "prefill.device=cuda", "decode.device=cuda")
    assert all(s.transfer_bytes == 0 for b in on_gpus.budgets.values() for s in b.stages)

    caches = caches_for(staged.rank(CONSUMER, 0).units, 4, fill="poison")
    listener = P2PListener(graph=staged, rank=0, caches=caches, spec=staged.spec.transfer)
    try:
        for cut in (c for c in staged.cuts if c.consumer_rank == 0):
            plan = cut.over(set(producer_caches_of(staged, 4)[cut.producer_rank]))
            assert 0 < listener.pair_buffer_bytes(plan) <= pair_buffer_bytes(staged.spec, cut)
    finally:
        listener.close()
