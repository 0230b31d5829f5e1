"""How one instance (the prefill or the decode side) is parallelised and sized."""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.spec.attention import AUTO, resolve_attention_backend
from pdflow.spec.dtypes import canonical_dtype

PARTITIONS = ("even", "lighter_last")


@dataclass(kw_only=True, slots=True)
class ParallelSpec:
    """One schema for both sides: ``prefill/`` and ``decode/`` options fill it."""

    tp: int = 1
    pp: int = 1
    # Layers per PP stage, explicit; None derives them from ``partition``.
    layer_partition: list[int] | None = None
    # How the graph derives the partition when none is given: "even" (earlier stages
    # take any remainder) or "lighter_last" (the drafter's stage gets ~4/5 of a share).
    partition: str = "even"
    block_size: int = 128
    # Page of the target KV binding; no default on purpose: every binding declares it.
    kv_page_tokens: int | None = None
    # "auto" follows the model dtype.
    kv_dtype: str = "auto"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    # Steps in flight at once; None: one per PP stage (stage 0 starts the next step while
    # later stages finish earlier ones). 1 turns the pipelining off (benchmark baseline).
    max_steps_in_flight: int | None = None
    # <= 1.0: the fraction of its device each rank may use (weights + KV + activations),
    # like vLLM's gpu_memory_utilization; > 1.0: bytes. None: 0.1 on cpu, 0.9 of a GPU,
    # split between the ranks of the run that share it (one-GPU P/D: 0.45 each).
    memory: float | None = None
    device: str = "cpu"
    # The device's size in GiB, overriding it: None reads a GPU's total memory when the
    # run starts (pdflow plan without a GPU assumes DESCRIBED_GPU_GIB); cpu is 4 GiB.
    device_memory_gib: float | None = None
    # GPU index of this instance's rank 0 on its host (rank r gets device_offset + r).
    # None: the graph places the prefill from GPU 0 and the decode right after the
    # prefill's ranks, so both sides can share one host (the reference deployment).
    device_offset: int | None = None
    # Fix the KV pool size instead of deriving it from memory (tests, tiny CPU runs).
    num_kv_blocks: int | None = None
    # A name from pdflow.attention.backends, or "auto" (resolved in __post_init__ by
    # spec/attention.py: triton on cuda, torch on cpu), so readers always see a name.
    attention_backend: str = AUTO
    # True: never replay CUDA graphs for decode steps (they need CUDA and the triton backend).
    enforce_eager: bool = False
    # Prefill and mixed steps as CUDA graphs cut at the attention calls (dense models, when
    # the decode graphs are on): an eager prefill step is host-bound on a GPU.
    piecewise_graphs: bool = True
    # torch.distributed rendezvous of this instance's ranks: a store the owner binds
    # before any rank starts (port 0: the OS picks a free one, atomically).
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Seconds a rank may take to start, and a step to answer, before the instance fails.
    ready_timeout_s: float = 120.0
    step_timeout_s: float = 300.0
    enable_prefix_caching: bool = True
    # Overlap scheduling: the host schedules and builds step N+1 while the device runs
    # step N (a decode's input token stays on the device until the host has it). None:
    # on for a one-rank CUDA side without a drafter; True elsewhere (CPU: tests) is
    # allowed where it can run and refused by the graph (OVERLAP_UNSUPPORTED) where not.
    overlap_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_page_tokens is not None and (
            self.kv_page_tokens < 1 or self.block_size % self.kv_page_tokens
        ):
            raise ValueError(
                f"kv_page_tokens ({self.kv_page_tokens}) must divide block_size ({self.block_size})"
            )
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition {self.partition!r} is not one of {PARTITIONS}")
        if self.memory is not None and self.memory <= 0:
            raise ValueError(f"memory must be a positive fraction or byte count, got {self.memory}")
        if self.max_steps_in_flight is not None and self.max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1 or null, got {self.max_steps_in_flight}")
        if self.device_offset is not None and self.device_offset < 0:
            raise ValueError(f"device_offset must be >= 0 or null, got {self.device_offset}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            raise ValueError(f"device_memory_gib must be positive, got {self.device_memory_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(
                f"num_kv_blocks must be >= 1 or null (sized from memory), got {self.num_kv_blocks}"
            )
        if self.kv_dtype != "auto":
            canonical_dtype(self.kv_dtype, "kv_dtype")
        if self.layer_partition is not None and len(self.layer_partition) != self.pp:
            # Cross-group facts (layer count) are checked by the graph; length is local.
            raise ValueError(
                f"layer_partition {list(self.layer_partition)} has {len(self.layer_partition)} "
                f"entries for pp={self.pp}; give one layer count per stage"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def steps_in_flight(self) -> int:
        return self.max_steps_in_flight or self.pp
