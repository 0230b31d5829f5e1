"""The Mooncake Transfer Engine behind pdflow's KV transfer: one engine per rank.

Direct writes (``transfer.staging=false``): each consumer rank registers its KV caches
once (``register_unit``) and a producer rank writes descriptor batches straight into
them, named by the consumer's session id (``host:rpc_port``, P2P handshake). Staged (the
``mooncake`` mover): each pair registers host staging on both ends. TCP works on
loopback with the non-CUDA wheel; RDMA takes the device from the spec.

What the engine needs from us:
- Registrations under 2 GiB, in chunks of whole blocks; no descriptor crosses a chunk.
- At most ``descriptor_batch`` descriptors a call: a TCP peer fails a larger batch.
- Retries with doubling backoff (writes are idempotent): a rejected write drops one of
  the peer's TCP lanes, so the next valid write may fail once.
- Our own deadline on every call, off the request path (``lanes``), and sync writes
  only (a failed async submit returns batch id 0, whose status query segfaults). A peer
  that never answers the handshake holds the engine's segment-map lock ~61 s for all.

Security: the engine's RPC and TCP data ports listen on ALL interfaces, unauthenticated,
whatever host it is given: run it on a trusted network. The pair listeners bind
``transfer.host`` and check ``grants``; direct writes have no such check.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from pdflow.graph.units import UnitSpec
from pdflow.spec import TransferSpec
from pdflow.transfer.descriptors import Descriptors, UnitRegion
from pdflow.transfer.errors import TransferError
from pdflow.transfer.lanes import Lanes
from pdflow.transfer.native_log import quiet_native_log, set_mooncake_level

__all__ = ["INSTALL_HINT", "REGISTRATION_LIMIT", "MooncakeTransport", "TransferError", "TransferStats"]

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU; needs Debian's libibverbs1) "
                "or mooncake-transfer-engine (CUDA), never both")
INIT_ATTEMPTS = 3
# Bytes per registration: strictly under 2 GiB.
REGISTRATION_LIMIT = (1 << 31) - 1


@dataclass(kw_only=True, slots=True)
class TransferStats:
    """Counters of engine calls (batches written, and those the engine failed): what the
    batching and retry tests read."""

    calls: int = 0
    failures: int = 0


class MooncakeTransport:
    def __init__(self, spec: TransferSpec):
        if spec.backend != "mooncake":
            raise ValueError(f"MooncakeTransport serves transfer.backend=mooncake, not {spec.backend!r}")
        if spec.protocol == "tcp":  # `protocol` only picks the allocator; discovery picks the transport
            os.environ.setdefault("MC_FORCE_TCP", "1")
        set_mooncake_level()  # quiet unless -v (native_log.py), before the library loads
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:  # the wheel, or a shared library it needs, is missing
            raise ImportError(f"Mooncake Transfer Engine unavailable ({err}); {INSTALL_HINT}") from err
        host = spec.host or "127.0.0.1"
        self.spec = spec
        self.registration_limit = REGISTRATION_LIMIT  # tests lower it
        # The engine picks its own RPC and data ports; another process can take one between
        # its pick and its bind, so a failed initialize is retried with a fresh engine.
        for attempt in range(INIT_ATTEMPTS):
            with quiet_native_log() as dropped:
                self.engine = TransferEngine()
                rc = self.engine.initialize(host, "P2PHANDSHAKE", spec.protocol, spec.device)
            if rc == 0:
                break
            if attempt + 1 == INIT_ATTEMPTS:
                raise TransferError(f"Mooncake initialize({host}, {spec.protocol}, {spec.device!r}) returned "
                                    f"{rc} {INIT_ATTEMPTS} times; its log:\n{''.join(dropped).strip()}")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.stats = TransferStats()
        self._stats_lock = threading.Lock()
        self._registered: dict[int, list[int]] = {}  # tensor address -> its chunk addresses
        self._lanes = Lanes()

    # -- memory ---------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, *, align: int = 1) -> int:
        """Make ``tensor``'s bytes readable and writable by peers, in chunks that are
        multiples of ``align`` bytes; returns its address."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if addr in self._registered:
            raise ValueError(f"memory at {addr:#x} is registered already")
        if not 0 < align <= self.registration_limit:
            raise ValueError(f"one block of {align} bytes does not fit one registration of "
                             f"<= {self.registration_limit} bytes")
        step = self.registration_limit // align * align  # the most whole ``align``s under the limit
        chunks: list[int] = []
        for start in range(addr, addr + nbytes, step):
            rc = self.engine.register_memory(start, min(step, addr + nbytes - start))
            if rc != 0:
                for done in chunks:
                    self.engine.unregister_memory(done)
                raise TransferError(f"register_memory({min(step, addr + nbytes - start)} bytes) returned {rc}")
            chunks.append(start)
        self._registered[addr] = chunks
        return addr

    def register_unit(self, unit: UnitSpec, cache: torch.Tensor) -> UnitRegion:
        """Register one unit's cache tensor (laid out as ``unit.cache_shape``) in chunks of
        whole blocks."""
        if tuple(cache.shape[1:]) != unit.cache_shape(cache.shape[0])[1:]:
            raise ValueError(f"{unit.name}: cache shape {tuple(cache.shape)} is not the unit's layout")
        if cache.element_size() != unit.itemsize:
            raise ValueError(f"{unit.name}: {cache.dtype} elements are not {unit.itemsize} bytes")
        # register() refuses a non-contiguous tensor, so block b starts b * bytes_per_block in.
        base = self.register(cache, align=unit.bytes_per_block)
        return UnitRegion(base=base, block_bytes=unit.bytes_per_block, num_blocks=cache.shape[0],
                          chunk_blocks=min(self.registration_limit // unit.bytes_per_block, cache.shape[0]))

    def unregister(self, addr: int) -> None:
        """Drop a registration made by ``register`` (every chunk of it)."""
        for chunk in self._registered.pop(addr, []):
            self.engine.unregister_memory(chunk)

    def unregister_all(self) -> None:
        for addr in list(self._registered):
            self.unregister(addr)

    # -- writes ---------------------------------------------------------------------

    def write(self, peer: str, descriptors: Descriptors) -> None:
        """Write every descriptor to ``peer`` (a session id) on its lane, off the caller's
        thread; raises ``TransferError`` on a persistent failure or at the deadline (even
        while the engine's call still blocks on the lane)."""
        deadline = time.monotonic() + self.spec.timeout_s

        def job(d: float) -> None:
            for src, dst, length in descriptors.batches(self.spec.descriptor_batch):
                self._write_batch(peer, src, dst, length, d)

        self._lanes.run(peer, job, deadline=deadline, what="write")

    def _write_batch(self, peer: str, src: list[int], dst: list[int], length: list[int], deadline: float) -> None:
        rc = None
        for attempt in range(self.spec.retries + 1):
            if attempt:
                pause = self.spec.retry_backoff_s * (2 ** (attempt - 1))
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise TransferError(f"write of {len(length)} runs to {peer}: deadline passed "
                                    f"after {attempt} attempts (last rc {rc})")
            rc = self.engine.batch_transfer_sync_write(peer, src, dst, length)
            with self._stats_lock:
                self.stats.calls += 1
                self.stats.failures += rc != 0
            if rc == 0:
                return
        raise TransferError(f"write of {len(length)} runs ({sum(length)} bytes) to {peer} returned {rc} "
                            f"{self.spec.retries + 1} times")

    def close(self) -> None:
        self.unregister_all()
        self._lanes.close()
