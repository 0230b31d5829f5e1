"""KV transfer between a producer (prefill) and a consumer (decode) instance.

Per rank: a ``MooncakeTransport`` (the transfer engine), an ``Endpoint`` (the side
channel), and a ``KVExporter`` (producer) or ``KVImporter`` (consumer) over the rank's
unit caches. The graph's cut plans say what moves where; nothing here computes a layout.
Import the submodules directly where the Mooncake wheel may be missing: this package
imports no engine until a transport is built.
"""

from pdflow.transfer.channel import ChannelError, Endpoint
from pdflow.transfer.errors import PairingRefused, TransferError
from pdflow.transfer.exporter import KVExporter
from pdflow.transfer.importer import ImportOutcome, KVImporter
from pdflow.transfer.messages import Hello, KVDone, KVWanted, Paired
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.pairing import check_hello, pair_with_producers

__all__ = [
    "ChannelError",
    "Endpoint",
    "Hello",
    "ImportOutcome",
    "KVDone",
    "KVExporter",
    "KVImporter",
    "KVWanted",
    "MooncakeTransport",
    "Paired",
    "PairingRefused",
    "TransferError",
    "check_hello",
    "pair_with_producers",
]
