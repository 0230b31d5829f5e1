"""The Mooncake Transfer Engine behind pdflow's KV transfer: one engine per rank.

Each rank registers its KV cache tensors (``register_unit``) once; a producer rank then writes descriptor
batches (``descriptors.block_descriptors``) straight into a consumer rank's registered
caches, named by the consumer's session id (``host:rpc_port``, P2P handshake, no
metadata server). TCP works on loopback with the non-CUDA wheel
(``mooncake-transfer-engine-non-cuda``); RDMA takes the device name from the spec. A
failed write raises ``TransferError`` at once (Mooncake returns an error code: unknown
peer, destination outside any registered buffer), so the caller can end the request.
"""

from __future__ import annotations

import torch

from pdflow.graph.units import UnitSpec
from pdflow.spec import TransferSpec
from pdflow.transfer.descriptors import Descriptors, UnitRegion

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU; needs Debian's libibverbs1) "
                "or mooncake-transfer-engine (CUDA), never both")


class TransferError(RuntimeError):
    """The transfer engine refused or failed a write; nothing says the bytes landed."""


class MooncakeTransport:
    def __init__(self, spec: TransferSpec, *, host: str = "127.0.0.1"):
        if spec.backend != "mooncake":
            raise ValueError(f"MooncakeTransport serves transfer.backend=mooncake, not {spec.backend!r}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:  # the wheel, or a shared library it needs, is missing
            raise ImportError(f"Mooncake Transfer Engine unavailable ({err}); {INSTALL_HINT}") from err
        self.spec = spec
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", spec.protocol, spec.device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host}, {spec.protocol}, {spec.device!r}) returned {rc}")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, tensor: torch.Tensor) -> int:
        """Make ``tensor``'s bytes readable and writable by peers; returns its address."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        rc = self.engine.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({nbytes} bytes) returned {rc}")
        self._registered.append(addr)
        return addr

    def register_unit(self, unit: UnitSpec, cache: torch.Tensor) -> UnitRegion:
        """Register one unit's cache tensor (laid out as ``unit.cache_shape``)."""
        if tuple(cache.shape[1:]) != unit.cache_shape(cache.shape[0])[1:]:
            raise ValueError(f"{unit.name}: cache shape {tuple(cache.shape)} is not the unit's layout")
        if cache.element_size() != unit.itemsize:
            raise ValueError(f"{unit.name}: {cache.dtype} elements are not {unit.itemsize} bytes")
        # register() refuses a non-contiguous tensor, so block b starts b * bytes_per_block in.
        return UnitRegion(base=self.register(cache), block_bytes=unit.bytes_per_block,
                          num_blocks=cache.shape[0])

    def write(self, peer: str, descriptors: Descriptors) -> None:
        """Write every descriptor to ``peer`` (a session id), ``descriptor_batch`` at a time."""
        for src, dst, length in descriptors.batches(self.spec.descriptor_batch):
            rc = self.engine.batch_transfer_sync_write(peer, src, dst, length)
            if rc != 0:
                raise TransferError(f"write of {len(length)} runs ({sum(length)} bytes) to {peer} "
                                    f"returned {rc}")

    def close(self) -> None:
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered = []
