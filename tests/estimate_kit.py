"""Hand-made step tables and profiles for the estimate's arithmetic tests: flat tables
make every priced figure a short hand computation."""

from __future__ import annotations

from pdflow.bench.profile import MachineProfile
from pdflow.bench.step_table import ShardTimes, StepTable, geometry_of
from pdflow.spec.load import compose_spec


def flat_shard(tp: int, threads: int, layer: float, head: float, contexts: tuple[int, int] = (64, 512)) -> ShardTimes:
    """Flat tables: every token count costs ``layer`` (dense and attention halves) a layer."""
    counts = (16, 64, 256, 1024, 2048)
    return ShardTimes(tp=tp, threads=threads, dense_s={t: layer / 2 for t in counts},
                      prefill_attention_s={t: layer / 2 for t in counts},
                      decode_s={c: {b: layer for b in (1, 4, 16, 64)} for c in contexts},
                      head_s={r: head for r in (1, 4, 16, 64)})


def tiny_profile(contexts: tuple[int, int] = (64, 512), **kw) -> MachineProfile:
    """The tiny model's table on a 2-core CPU (TP1 at 2 and 1 threads, TP2, TP4), ``kw``
    overriding any field."""
    table = StepTable(model="tiny", geometry=geometry_of(compose_spec(["model=tiny"]).model, "cpu"),
                      shards=[flat_shard(1, 2, 1e-3, 5e-4, contexts), flat_shard(1, 1, 2e-3, 6e-4, contexts),
                              flat_shard(2, 1, 3e-3, 7e-4, contexts), flat_shard(4, 1, 4e-3, 8e-4, contexts)])
    base = dict(device="cpu", host="test", cores=2, gemm_flops_s=1e9, gemm_flops_s_one_thread=1e9,
                mem_bytes_s=1e15, host_copy_bytes_s=1e9, transfer_bytes_s={"mooncake": 1e9, "gloo": 1e9},
                transfer_latency_s={"mooncake": 1e-3, "gloo": 1e-4}, rank_message_s=2e-4, step_overhead_s=0.5,
                rank_step_overhead_s=0.7, allreduce_s=5e-4, hop_s=3e-4, version=2, step_tables=[table],
                table_step_overhead_s=0.01, table_rank_step_overhead_s=2e-3)
    return MachineProfile(**(base | kw))
