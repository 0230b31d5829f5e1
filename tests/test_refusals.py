"""One test per refusal code: a config that triggers it (and only it), and a near miss
that is accepted."""

from __future__ import annotations

import pytest

from pdflow.graph import Code
from pdflow.graph.refusals import HOST_ONLY, PAIRING_ONLY
from pdflow.spec import attention

MHA_K0 = "mha.fp32_d64.k.layer_0"
MHA_K1 = "mha.fp32_d64.k.layer_1"

# code -> (overrides that trigger only it, overrides of the near miss that is accepted)
CASES = {
    Code.EAGLE3_UNDER_PP: (
        ["prefill=pp4", "decode=tp4", "drafter=eagle3"],
        ["prefill=tp4", "decode=tp4", "drafter=eagle3"],
    ),
    Code.HEAD_CUT_NOT_DIVISIBLE: (["decode.tp=3"], ["decode.tp=2"]),
    Code.UNIT_MISMATCH_HEAD_DIM: (
        [
            "drafter.head_dim=32",
            "drafter.page_tokens=128",
            f"+transfer.consumer_map={{{MHA_K0}:draft.fp32_d32.k.layer_0,draft.fp32_d32.k.layer_0:{MHA_K0}}}",
        ],
        [
            "drafter.head_dim=64",
            "drafter.page_tokens=128",
            f"+transfer.consumer_map={{{MHA_K0}:draft.fp32_d64.k.layer_0,draft.fp32_d64.k.layer_0:{MHA_K0}}}",
        ],
    ),
    Code.UNIT_MISMATCH_HEADS: (
        [
            "drafter.kv_heads=2",
            "drafter.page_tokens=128",
            f"+transfer.consumer_map={{{MHA_K0}:draft.fp32_d64.k.layer_0,draft.fp32_d64.k.layer_0:{MHA_K0}}}",
        ],
        [
            "drafter.kv_heads=4",
            "drafter.page_tokens=128",
            f"+transfer.consumer_map={{{MHA_K0}:draft.fp32_d64.k.layer_0,draft.fp32_d64.k.layer_0:{MHA_K0}}}",
        ],
    ),
    Code.UNIT_MISMATCH_DTYPE: (["decode.kv_dtype=bf16"], ["decode.kv_dtype=bf16", "prefill.kv_dtype=bf16"]),
    Code.UNIT_MISMATCH_PAGE: (
        ["decode.kv_page_tokens=16"],
        ["decode.kv_page_tokens=16", "prefill.kv_page_tokens=16"],
    ),
    Code.UNIT_MISMATCH_BLOCK: (
        ["decode.block_size=256"],
        ["decode.block_size=256", "prefill.block_size=256"],
    ),
    Code.PAGE_UNDECLARED: (["prefill.kv_page_tokens=null"], ["prefill.kv_page_tokens=128"]),
    Code.PAGE_NOT_DIVIDING_BLOCK: (["drafter.page_tokens=48"], ["drafter.page_tokens=32"]),
    Code.REGION_MISSING: (
        [f"+transfer.consumer_map={{mha.fp32_d64.k.layer_99:{MHA_K0}}}"],
        [f"+transfer.consumer_map={{{MHA_K0}:{MHA_K0}}}"],
    ),
    Code.REGION_UNFILLED: (
        [f"+transfer.consumer_map={{{MHA_K0}:''}}"],
        [f"+transfer.consumer_map={{{MHA_K0}:{MHA_K0}}}"],
    ),
    Code.BATCH_OVER_GRID_LIMIT: (
        # x4 KV heads per TP1 stage = 65536 rows on a backend that caps them at 65535
        ["prefill.attention_backend=grid_capped", "prefill.max_num_batched_tokens=16384"],
        ["prefill.attention_backend=grid_capped", "prefill.max_num_batched_tokens=16383"],
    ),
    Code.BAD_LAYER_PARTITION: (["prefill.layer_partition=[3,3,1,2]"], ["prefill.layer_partition=[3,3,1,1]"]),
    Code.DRAFTER_TAP_OUT_OF_RANGE: (["drafter.taps=[1,8]"], ["drafter.taps=[1,7]"]),
    Code.KV_POOL_EMPTY: (["prefill.memory=0.001"], ["prefill.memory=0.1"]),
    # The shipped tiny model's checkpoint (model.path) has a 128-token vocab.
    Code.MODEL_GEOMETRY_MISMATCH: (["model.vocab=256"], ["model.vocab=128"]),
    # Experts of intermediate width 6 on the default TP4 decode side (no expert parallelism).
    Code.EXPERT_SPLIT_NOT_DIVISIBLE: (
        ["model.path=null", "model.experts=4", "model.experts_per_token=2", "model.moe_intermediate=6"],
        ["model.path=null", "model.experts=4", "model.experts_per_token=2", "model.moe_intermediate=8"],
    ),
    # The default decode side is TP4 with a drafter: overlap scheduling cannot run there.
    Code.OVERLAP_UNSUPPORTED: (["decode.overlap_scheduling=true"], ["decode.overlap_scheduling=false"]),
    Code.KV_DTYPE_UNSUPPORTED: (["model.kv_dtype=fp8_e5m2"], ["model.kv_dtype=fp8_e4m3"]),
    # fp8 KV on GPUs: a page-4 scale run is 4 bytes, under the copy kernels' 8-byte word.
    Code.KV_SCALE_PAGE_UNALIGNED: (
        ["model.kv_dtype=fp8_e4m3", "prefill.device=cuda", "decode.device=cuda", "drafter=none",
         "prefill.kv_page_tokens=4", "decode.kv_page_tokens=4"],
        ["model.kv_dtype=fp8_e4m3", "prefill.device=cuda", "decode.device=cuda", "drafter=none",
         "prefill.kv_page_tokens=8", "decode.kv_page_tokens=8"],
    ),
}


@pytest.fixture(autouse=True)
def grid_capped_backend(monkeypatch):
    """A backend whose kernels put rows on a capped grid axis (none of pdflow's do)."""
    monkeypatch.setitem(attention.BACKEND_LIMITS, "grid_capped",
                        attention.BackendLimits(grid_row_limit=65535))


@pytest.mark.parametrize("code", list(CASES), ids=str)
def test_refusal_triggers_only_its_code(graph_of, code):
    graph = graph_of(*CASES[code][0])
    assert {r.code for r in graph.validate()} == {code}
    for refusal in graph.validate():
        assert refusal.message and refusal.fix


@pytest.mark.parametrize("code", list(CASES), ids=str)
def test_near_miss_is_accepted(graph_of, code):
    graph = graph_of(*CASES[code][1])
    assert graph.validate() == []
    assert graph.cuts and all(b.pool_blocks > 0 for b in graph.budgets.values())


def test_every_code_has_a_case():
    # pairing: test_transfer_pairing; host: test_graph_host, test_conf_coverage
    assert set(CASES) | {Code.REGION_TWO_TO_ONE} | PAIRING_ONLY | HOST_ONLY == set(Code)


def test_two_producers_into_one_consumer_unit(graph_of):
    # Unit names are one-to-one across sides, so sending layer 1 into layer 0 also leaves
    # layer 1 unfilled: both must be reported, together.
    graph = graph_of(f"+transfer.consumer_map={{{MHA_K1}:{MHA_K0}}}")
    assert graph.codes() == {Code.REGION_TWO_TO_ONE, Code.REGION_UNFILLED}
    two = [r for r in graph.validate() if r.code is Code.REGION_TWO_TO_ONE]
    assert MHA_K0 in two[0].message and MHA_K1 in two[0].message


def test_cross_side_tp_not_multiple(graph_of):
    # tp8 and tp12 each replicate 4 KV heads, but 12 is no multiple of 8.
    graph = graph_of("prefill=tp4", "prefill.tp=8", "decode.tp=12")
    assert graph.codes() == {Code.HEAD_CUT_NOT_DIVISIBLE}
    assert "producer tp=8 and consumer tp=12" in graph.validate()[0].message


def test_all_refusals_reported_at_once(graph_of):
    graph = graph_of(
        "prefill=pp4", "drafter=eagle3", "prefill.max_num_batched_tokens=16400", "decode.kv_dtype=bf16",
        "prefill.attention_backend=grid_capped",
    )
    assert graph.codes() == {Code.EAGLE3_UNDER_PP, Code.BATCH_OVER_GRID_LIMIT, Code.UNIT_MISMATCH_DTYPE}


def test_pp_larger_than_layers_is_a_bad_partition(graph_of):
    graph = graph_of("prefill.pp=9")
    assert graph.codes() == {Code.BAD_LAYER_PARTITION}
    assert graph.producer is None  # placement is not attempted


def test_group_level_checks_raise_value_errors():
    from pdflow.spec import DrafterSpec, ParallelSpec

    with pytest.raises(ValueError, match="kv_page_tokens"):
        ParallelSpec(block_size=128, kv_page_tokens=48)
    with pytest.raises(ValueError, match="one layer count per stage"):
        ParallelSpec(pp=2, layer_partition=[4, 2, 2])
    with pytest.raises(ValueError, match="increasing"):
        DrafterSpec(kind="dspark", num_speculative_tokens=2, layers=1, kv_heads=1, head_dim=8, taps=[3, 1])
    with pytest.raises(ValueError, match="dspark only"):
        DrafterSpec(kind="eagle", num_speculative_tokens=2, layers=1, kv_heads=1, head_dim=8, taps=[1])
