"""One request to several consumer ranks at once.

A producer rank pairs with every consumer rank its cut plans name (a PP stage with each of
a TP decode's ranks). Sent one pair after another, a request's transfer takes the sum of
the pairs' times, though the pairs share nothing but the producer's caches: on GPUs one
pair may be a copy on the same device and another an NCCL transfer over NVLink, and each
spends much of its time waiting on the other side. Here each pair sends on a thread of its
own (GPU work on the pair's own stream, ordered after the caller's), so the request takes
about the slowest pair's time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from pdflow.transfer.p2p import P2PPeer


class Fanout:
    """A producer rank's pairs (consumer rank -> ``P2PPeer``), sent to together."""

    def __init__(self, peers: Mapping[int, P2PPeer]):
        self.peers = dict(peers)
        many = len(self.peers) > 1
        self._pool = ThreadPoolExecutor(max_workers=len(self.peers), thread_name_prefix="p2p-send") if many else None

    def send(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], request_id: str = "") -> None:
        """Move one request to every pair; returns when every pair has finished, raising
        the first failure (a ``TransferError``) only then, so no pair is left mid-request."""
        if self._pool is None:
            for peer in self.peers.values():
                peer.send(src_blocks, dst_blocks, request_id)
            return
        after = _written(self.peers.values())
        futures = [self._pool.submit(peer.send, src_blocks, dst_blocks, request_id, after=after)
                   for peer in self.peers.values()]
        errors = [f.exception() for f in futures]  # waits for each; every pair has its own deadlines
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _written(peers) -> torch.cuda.Event | None:
    """An event on the calling thread's stream, where the request's KV was written: the
    pairs' threads have streams of their own and must not read before it."""
    devices = {p.device for p in peers if p.stream is not None}
    if not devices:
        return None
    if len(devices) > 1:
        raise ValueError(f"one producer rank's caches live on one device, not {sorted(map(str, devices))}")
    return torch.cuda.current_stream(devices.pop()).record_event()
