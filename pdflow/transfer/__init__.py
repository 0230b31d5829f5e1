"""KV transfer between a producer (prefill) and a consumer (decode) instance: the
two-sided pairs of ``p2p`` for every mover, and Mooncake's one-sided writes into
registered caches (``transfer.staging=false``). The graph's cut plans say what moves
where. No engine is imported until a transport is built (the wheel may be missing).
"""

from pdflow.transfer.errors import PairingRefused, TransferError

__all__ = ["PairingRefused", "TransferError"]
