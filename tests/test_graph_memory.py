"""GPU pools are sized from the device like vLLM's gpu_memory_utilization: ``memory`` is a
fraction of the GPU's total (read at start, passed in as ``DeviceFacts``; here described,
no GPU needed), ``device_memory_gib`` only overrides it, two instances on one GPU split
it, the ranks must fit in what is free, and a monolithic run neither sizes nor checks
the prefill side it never starts."""

from __future__ import annotations

import pytest

from pdflow.graph import Code, build_graph
from pdflow.graph.devices import DeviceFacts, GpuMemory
from pdflow.graph.memory import GIB
from pdflow.spec.load import compose_spec

ONE_GPU = ["prefill=tp1", "decode=tp1", "drafter=none", "prefill.device=cuda", "decode.device=cuda",
           "decode.device_offset=0"]
TWO_GPUS = ["prefill=tp1", "decode=tp1", "drafter=none", "prefill.device=cuda", "decode.device=cuda"]


def _h200(*free_gib: float) -> DeviceFacts:
    return DeviceFacts(gpus=tuple(GpuMemory(index=i, total_bytes=140 * GIB, free_bytes=int(f * GIB))
                                  for i, f in enumerate(free_gib)))


def _usable(graph, role: str) -> int:
    return graph.budgets[role].stages[0].usable_bytes


def test_memory_is_a_fraction_of_the_device_read_at_start():
    graph = build_graph(compose_spec([*TWO_GPUS, "decode.memory=0.5"]), _h200(139, 139))
    assert graph.refusals == ()
    assert _usable(graph, "prefill") == int(0.9 * 140 * GIB)  # default 0.9, a GPU of its own
    assert _usable(graph, "decode") == int(0.5 * 140 * GIB)
    assert "of 140.0 GiB (GPU 1, read at start)" in graph.budgets["decode"].sizing
    # A bigger device gives a bigger pool: the facts, not a constant, size it.
    small = build_graph(compose_spec(TWO_GPUS), DeviceFacts(gpus=(
        GpuMemory(index=0, total_bytes=24 * GIB, free_bytes=23 * GIB),
        GpuMemory(index=1, total_bytes=24 * GIB, free_bytes=23 * GIB))))
    assert small.budgets["decode"].pool_blocks < graph.budgets["prefill"].pool_blocks


def test_device_memory_gib_overrides_what_the_device_says():
    graph = build_graph(compose_spec([*TWO_GPUS, "decode.device_memory_gib=10", "decode.memory=0.5"]),
                        _h200(139, 139))
    assert _usable(graph, "decode") == 5 * GIB
    assert "device_memory_gib" in graph.budgets["decode"].sizing


def test_two_instances_on_one_gpu_split_it_by_default():
    shared = build_graph(compose_spec(ONE_GPU), _h200(139))
    assert shared.refusals == ()
    for role in ("prefill", "decode"):
        assert _usable(shared, role) == int(0.45 * 140 * GIB)
        assert "split by 2" in shared.budgets[role].sizing
    # Each given its own fraction: taken as given, and then both must fit in what is free.
    greedy = build_graph(compose_spec([*ONE_GPU, "prefill.memory=0.9", "decode.memory=0.9"]), _h200(139))
    assert greedy.codes() == {Code.DEVICE_MEMORY_SHORT}
    assert "GPU 0 has 139.0 GiB free" in str(greedy.refusals[0])


def test_a_gpu_partly_taken_by_another_process_is_refused_not_overcommitted():
    busy = build_graph(compose_spec(TWO_GPUS), _h200(139, 60))
    assert busy.codes() == {Code.DEVICE_MEMORY_SHORT}
    assert "decode.s0.t0" in busy.refusals[0].message and "prefill" not in busy.refusals[0].message
    # A separately started prefill instance starts only its own ranks: GPU 1 is not its.
    assert build_graph(compose_spec([*TWO_GPUS, "serve.role=prefill"]), _h200(139, 60)).refusals == ()
    fits = build_graph(compose_spec([*TWO_GPUS, "decode.memory=0.4"]), _h200(139, 60))
    assert fits.refusals == ()


def test_plan_without_a_device_sizes_the_described_hardware():
    planned = build_graph(compose_spec(ONE_GPU))
    assert planned.refusals == ()
    assert "described, no GPU read" in planned.budgets["decode"].sizing
    cpu = build_graph(compose_spec(["prefill=tp1", "decode=tp1", "drafter=none"]))
    assert _usable(cpu, "decode") == int(0.1 * 4 * GIB)  # the CPU default is unchanged


@pytest.mark.parametrize("prefill", ["prefill.pp=16", "prefill.memory=1000"])
def test_monolithic_neither_sizes_nor_checks_the_prefill_side(prefill):
    """The prefill side a monolithic run never starts: too deep a PP for the model
    (BAD_LAYER_PARTITION) or too little memory (KV_POOL_EMPTY) must not refuse it."""
    mono = ["mode=monolithic", "decode=tp1", "decode.device=cuda", prefill]
    graph = build_graph(compose_spec(mono), _h200(139))
    assert graph.refusals == () and graph.producer is None and set(graph.budgets) == {"decode"}
    assert _usable(graph, "decode") == int(0.9 * 140 * GIB)  # no prefill shares its GPU
    # The same prefill side in a P/D run is refused: the check is skipped, not broken.
    pd = build_graph(compose_spec(["decode=tp1", "decode.device=cuda", "decode.device_offset=4", prefill]),
                     _h200(*[139] * 5))
    assert pd.codes() & {Code.BAD_LAYER_PARTITION, Code.KV_POOL_EMPTY}


@pytest.mark.gpu
def test_a_real_gpu_sizes_the_pool_from_its_memory():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pdflow.graph.host import read_devices

    spec = compose_spec(ONE_GPU)
    facts = read_devices(spec)
    free, total = torch.cuda.mem_get_info(0)
    gpu = facts.gpu(0)  # NVML's or torch's reading: the same device within a GiB
    assert abs(gpu.total_bytes - total) < GIB and 0 < gpu.free_bytes <= gpu.total_bytes
    graph = build_graph(spec, facts).raise_if_refused()
    assert _usable(graph, "decode") == int(0.45 * gpu.total_bytes)
    assert "read at start" in graph.budgets["decode"].sizing


def test_asking_a_monolithic_graph_for_its_prefill_instance_says_what_to_do():
    graph = build_graph(compose_spec(["mode=monolithic", "decode=tp1"]))
    assert graph.producer is None and not graph.refusals
    with pytest.raises(ValueError, match="mode=pd"):
        graph.instance("prefill")


@pytest.mark.parametrize(("overrides", "pairs"), [
    (["prefill=pp4", "decode=tp4"], 16),  # every stage writes every decode rank's heads
    (["prefill=tp1", "decode=tp1"], 1),
    (["mode=monolithic"], 0),  # nothing moves
])
def test_the_graph_counts_the_rank_pairs_a_prompts_kv_moves_over(overrides, pairs):
    assert build_graph(compose_spec(["model=tiny", "drafter=none", *overrides])).kv_pairs == pairs
