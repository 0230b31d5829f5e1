"""KV transfer between a producer (prefill) and a consumer (decode) instance.

What the engine's ranks run (``pdflow.worker.kv_link``): the two-sided pairs of ``p2p``
(``P2PPeer`` on a producer rank, ``P2PListener`` on a consumer rank) for every mover, and
Mooncake's one-sided writes into registered caches (``transfer.staging=false``). The
graph's cut plans say what moves where; nothing here computes a layout. Import the
submodules directly where the Mooncake wheel may be missing: this package imports no
engine until a transport is built.
"""

from pdflow.transfer.errors import PairingRefused, TransferError

__all__ = ["PairingRefused", "TransferError"]
