"""KV transfer between producer and consumer instances."""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO = "auto"
BACKENDS = (AUTO, "mooncake", "nccl")
PROTOCOLS = ("tcp", "rdma")
TCP_PEER_QUEUE = 1024


@dataclass(kw_only=True, slots=True)
class TransferSpec:
    # "auto" (the default, resolved by ``resolve_auto`` when the run spec is built, so
    # readers always see a backend): cuda_ipc between GPUs of one host, Mooncake otherwise.
    backend: str = "mooncake"
    protocol: str = "tcp"
    # RDMA device name(s) for Mooncake; empty for TCP.
    device: str = ""
    # The address this host's ranks give their peers for KV writes (Mooncake's local
    # hostname); empty: 127.0.0.1. Set it to the host's reachable IP when the producer and
    # the consumer run on different hosts.
    host: str = ""
    # First port of the per-rank handshake listeners; 0 picks free loopback ports.
    handshake_base_port: int = 0
    # Explicit producer-unit -> consumer-unit names ("" = not sent); others map by name.
    consumer_map: dict[str, str] = field(default_factory=dict)
    # Runs per descriptor batch submitted to the engine. Mooncake's TCP transport queues
    # about 1024 per peer and fails a larger batch at once.
    descriptor_batch: int = 256
    # Mooncake: pack a request's runs per consumer rank and write them chunk by chunk into
    # its registered host staging (the ``mooncake`` mover, transfer/movers/staged_mooncake.py) instead of one
    # descriptor per run into its caches (RDMA). Chosen by scripts/bench_pd_mover.py.
    staging: bool = True
    # A pair's receive buffer (and the producer's send buffer of it): a request larger
    # than it moves in chunks. Less when the longest request packs into less.
    staging_mib: int = 256
    # transfer=nccl with GPU caches on one host: the producer's copy kernel writes every cut
    # run straight into the consumer's caches, mapped through CUDA IPC (over NVLink between
    # GPUs that can reach each other's memory; one launch per request, no receive buffer,
    # no pack or scatter). false: pack into chunks moved by NCCL (or through an IPC-mapped
    # receive buffer when both ranks share a GPU). GPUs without peer access fall back.
    peer_writes: bool = False
    # Pipelined pairs (transfer=nccl between GPUs, packed): the first and last chunks of a
    # request are the receive buffer's half >> chunk_ramp, doubling up and halving down, so
    # the first send starts after a short pack and the last scatter is short, at the cost of
    # more messages. 0 (default): even chunks; on two H200s ramps of 2-3 measured no gain.
    chunk_ramp: int = 0
    # Pack, scatter and direct writes on a GPU: at most this many programs per copy launch
    # (each walks run slices with the grid's stride), leaving NCCL's kernels SMs and memory
    # bandwidth while a chunk is on the wire; 0 (default): one program per run slice.
    copy_programs: int = 0
    # A request's transfer deadline, on both sides.
    timeout_s: float = 30.0
    # Unit families ("mha", "draft") cut as if their page were the whole block: a
    # deliberate fault that hands every consumer rank another head's bytes with no error,
    # for showing that accuracy and acceptance expose it. Never set in a real deployment.
    force_page_ignorant_cut: list[str] = field(default_factory=list)
    # Scale units (an fp8 KV cache's) cut from another head of the producer rank than
    # their KV: a deliberate fault (each head's values arrive with a neighbour's scales),
    # for showing that tests catch a wrong scale cut. Never set in a real deployment.
    force_wrong_scale_cut: bool = False
    # Extra attempts of a failed descriptor batch (a rejected write drops one of the
    # peer's TCP lanes, so the next one may fail once), waiting backoff, 2x, 4x, ...
    retries: int = 3
    retry_backoff_s: float = 0.02
    # What transfer=auto chose and why (set by ``resolve_auto``; empty when named).
    chosen: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"transfer.backend {self.backend!r} is not one of {BACKENDS}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"transfer.protocol {self.protocol!r} is not one of {PROTOCOLS}")
        bad = set(self.force_page_ignorant_cut) - {"mha", "draft"}
        if bad:
            raise ValueError(f"transfer.force_page_ignorant_cut takes unit families mha, draft; got {sorted(bad)}")
        if self.descriptor_batch < 1:
            raise ValueError("transfer.descriptor_batch must be >= 1")
        if self.protocol == "tcp" and self.descriptor_batch > TCP_PEER_QUEUE:
            raise ValueError(f"transfer.descriptor_batch={self.descriptor_batch}: Mooncake's TCP transport "
                             f"queues about {TCP_PEER_QUEUE} descriptors per peer and fails a larger batch at "
                             f"once; use at most {TCP_PEER_QUEUE}")
        if not 1 <= self.staging_mib < 2048:
            raise ValueError("transfer.staging_mib must be 1..2047 (one registration stays under 2 GiB)")
        if not 0 <= self.chunk_ramp <= 8:
            raise ValueError("transfer.chunk_ramp must be 0..8 (halvings of the first and last chunks)")
        if self.copy_programs < 0:
            raise ValueError("transfer.copy_programs must be >= 0 (0: one program per run slice)")
        if self.timeout_s <= 0:
            raise ValueError("transfer.timeout_s must be > 0")
        if self.retries < 0 or self.retry_backoff_s < 0:
            raise ValueError("transfer.retries and transfer.retry_backoff_s must be >= 0")
        if not 0 <= self.handshake_base_port < 65536:
            raise ValueError("transfer.handshake_base_port must be 0 (pick free) or a port number")

    def resolve_auto(self, *, devices: set[str], one_owner: bool) -> None:
        """Settle ``backend: auto`` from where the caches live: GPU caches of instances one
        owner process starts (so one host) -> cuda_ipc (peer writes; nccl where the GPUs
        cannot reach each other); CPU caches, or instances started separately (maybe on
        other hosts) -> Mooncake over TCP with staging, as transfer=mooncake_tcp."""
        if self.backend != AUTO:
            return
        if devices == {"cuda"} and one_owner:
            self.backend, self.peer_writes = "nccl", True
            self.chosen = "auto: GPU caches of one host"
            return
        self.backend, self.protocol, self.staging = "mooncake", "tcp", True
        why = "CPU caches" if "cuda" not in devices else "instances started separately, maybe on other hosts"
        self.chosen = f"auto: {why}"
