"""KV transfer between producer and consumer instances."""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("mooncake", "nccl")
PROTOCOLS = ("tcp", "rdma")


@dataclass(kw_only=True, slots=True)
class TransferSpec:
    backend: str = "mooncake"
    protocol: str = "tcp"
    # RDMA device name(s) for Mooncake; empty for TCP.
    device: str = ""
    # First port of the per-rank handshake listeners; 0 picks free loopback ports.
    handshake_base_port: int = 0
    # Explicit producer-unit -> consumer-unit names ("" = not sent); others map by name.
    consumer_map: dict[str, str] = field(default_factory=dict)
    # Runs per descriptor batch submitted to the engine.
    descriptor_batch: int = 256
    # Pack a request's runs into one staging buffer per consumer rank (TCP) instead of
    # one descriptor per run (RDMA).
    staging: bool = True
    timeout_s: float = 30.0
    # Unit families ("mha", "draft") cut as if their page were the whole block: a
    # deliberate fault that hands every consumer rank another head's bytes with no error,
    # for showing that accuracy and acceptance expose it. Never set in a real deployment.
    force_page_ignorant_cut: list[str] = field(default_factory=list)

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
        if not 0 <= self.handshake_base_port < 65536:
            raise ValueError("transfer.handshake_base_port must be 0 (pick free) or a port number")
