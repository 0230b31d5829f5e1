"""Where an instance's ranks meet: a torch.distributed ``TCPStore`` the owner holds.

Why the owner, not rank 0: asking the OS for a free port, closing it, and handing the
number to rank 0 to bind later is check-then-use; another process (another instance
starting beside this one) can take the port in between, and the rendezvous fails with
EADDRINUSE. The owner instead binds the store itself (port 0: the OS picks one, bound
at once) and hands ranks the port it got; ranks only connect. The store lives as long
as the owner's launcher, so NCCL's lazily built communicators still find it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreAddress:
    """The owner's store, as a rank connects to it."""

    host: str
    port: int


class RendezvousError(RuntimeError):
    """The owner could not bind its rendezvous store (a fixed ``master_port`` is taken)."""


class RankRendezvous:
    """The owner's end: a bound, listening store (``port`` 0: the OS picks a free one)."""

    def __init__(self, host: str, port: int, timeout_s: float):
        try:
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout_s))
        except dist.DistNetworkError as err:
            raise RendezvousError(
                f"cannot listen for the ranks' rendezvous on {host}:{port} ({err}); "
                "set the side's master_port to 0 (the default) to let the OS pick a free port") from err
        self.address = StoreAddress(host=host, port=self._store.port)

    def close(self) -> None:
        self._store = None  # the server stops when the last reference goes


def join_process_group(address: StoreAddress, backend: str, rank: int, world_size: int,
                       timeout_s: float) -> None:
    """A rank's end: connect to the owner's store and join the default process group."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
