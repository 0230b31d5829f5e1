"""A rank's end of P/D KV transfer: register its pool, pair with consumers, export.

A consumer rank registers every unit cache with the transfer engine and publishes a
``KVEndpoint`` (session id, addresses, and the layout each unit was built with). A
producer rank checks every endpoint it will write to against its own run graph at
pairing, and refuses a mismatch there, by the graph's refusal code, before a byte moves.
Its sender (``worker.kv_sender``) writes each exported request's blocks to every
consumer rank its cut plans name, off the forward: the bytes and offsets come from the
graph's ``CutPlan``, the addresses from the endpoints (``transfer.descriptors``).

A producer rank keeps a peer table keyed by consumer instance id: pairing with one more
consumer adds its peers and leaves the others' (and their exports in flight) alone, so
one prefill instance serves many decode instances without draining between them. A
consumer that stopped or failed is forgotten: its peers (sockets, host staging, groups)
close and leave the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdflow.graph import CONSUMER, PRODUCER, Code, CutPlan, Refusal, RunGraph, UnitSpec
from pdflow.graph.regions import unit_mismatches
from pdflow.parallel.messages import KVEndpoint, KVExport, UnitAddress
from pdflow.transfer.descriptors import UnitRegion, block_descriptors
from pdflow.transfer.errors import PairingRefused, TransferError
from pdflow.transfer.mooncake_engine import MooncakeTransport
from pdflow.transfer.p2p import P2PListener, P2PPeer, device_identity


def _address(unit: UnitSpec, region: UnitRegion) -> UnitAddress:
    return UnitAddress(
        name=unit.name, base=region.base, block_bytes=region.block_bytes,
        num_blocks=region.num_blocks, chunk_blocks=region.chunk_blocks, family=unit.family, field=unit.field, layer=unit.layer,
        heads=list(unit.heads), head_dim=unit.head_dim,
        dtype=unit.dtype, page_tokens=unit.page_tokens, block_size=unit.block_size,
    )


def _published_unit(address: UnitAddress) -> UnitSpec:
    return UnitSpec(family=address.family, field=address.field, layer=address.layer,
                    heads=tuple(address.heads), head_dim=address.head_dim, dtype=address.dtype,
                    page_tokens=address.page_tokens, block_size=address.block_size)


def endpoint_refusals(expected: dict[str, UnitSpec], endpoint: KVEndpoint, rank_label: str) -> list[Refusal]:
    """Every reason to refuse an endpoint whose units are not the ones the plan writes into
    (the graph's unit checks, matched by family, field and layer: a unit of another
    geometry is a mismatch, not a gap)."""
    published = {(u.family, u.field, u.layer): u for u in endpoint.units}
    refusals = []
    for name, unit in expected.items():
        got = published.get((unit.family, unit.field, unit.layer))
        if got is None:
            refusals.append(Refusal(code=Code.REGION_MISSING,
                                    message=f"consumer rank {rank_label} publishes no unit {name}.",
                                    fix="build both instances from the same run spec."))
            continue
        refusals += unit_mismatches(unit, _published_unit(got),
                                    pair=f"plan unit {name} -> consumer rank {rank_label} unit {got.name}")
        if not refusals and got.block_bytes != unit.bytes_per_block:
            refusals.append(Refusal(code=Code.PAIRING_REGION_INVALID,
                                    message=f"{got.name} on consumer rank {rank_label} has {got.block_bytes} "
                                    f"bytes per block, the plan {unit.bytes_per_block}.",
                                    fix="build both instances from the same run spec."))
    return refusals


@dataclass(kw_only=True, slots=True)
class ConsumerPeers:
    """One consumer instance's ranks as a producer rank writes them: direct Mooncake
    (session id, its unit regions, the cut) or a p2p pair, by consumer rank."""

    direct: dict[int, tuple[str, dict[str, UnitRegion], CutPlan]] = field(default_factory=dict)
    p2p: dict[int, P2PPeer] = field(default_factory=dict)

    def close(self) -> None:
        for peer in self.p2p.values():
            peer.close()


class KVLink:
    """One rank's KV transfer: Mooncake (one-sided writes into registered memory) or, with
    ``transfer=nccl``, the two-sided point-to-point pairs of ``transfer.p2p``."""

    def __init__(self, graph: RunGraph, role: str, rank: int, caches: dict[str, torch.Tensor]):
        self.graph, self.role, self.rank = graph, role, rank
        self.units = {u.name: u for u in graph.rank(role, rank).units if u.name in caches}
        self.caches = {name: caches[name] for name in self.units}
        spec = graph.spec.transfer
        # Two-sided pairs (transfer.p2p): NCCL/IPC/Gloo, or Mooncake through packed host
        # staging (transfer.staging); else Mooncake writes every cut run in place.
        self.p2p = spec.backend == "nccl" or spec.staging
        self.transport = self.listener = None
        if self.p2p:
            if spec.backend == "mooncake":
                self.transport = MooncakeTransport(spec)
            self.regions = {name: _local_region(unit, caches[name]) for name, unit in self.units.items()}
            if role == CONSUMER and self.caches:
                self.listener = P2PListener(graph=graph, rank=rank, caches=self.caches, spec=spec,
                                            transport=self.transport)
        else:
            self.transport = MooncakeTransport(graph.spec.transfer)
            self.regions = {name: self.transport.register_unit(unit, caches[name])
                            for name, unit in self.units.items()}
        # Producer side: consumer instance id -> its ranks' peers. Replaced whole (never
        # mutated in place) as consumers pair, so the sender's threads read it unlocked.
        self.consumers: dict[str, ConsumerPeers] = {}
        self._consumer_ranks = graph.consumer_ranks_of(rank)

    def open(self, key: bytes) -> KVEndpoint:
        """Take the consumer owner's pairing key (the listener checks producers' hellos and
        each request's nonce with it) and publish this rank's endpoint."""
        if self.listener is not None and key:
            self.listener.key = key
        return self.endpoint()

    def endpoint(self) -> KVEndpoint:
        if self.p2p:
            session = self.listener.address if self.listener is not None else ""
        else:
            session = self.transport.session_id
        device = device_identity(next(iter(self.caches.values())).device) if self.caches else ""
        return KVEndpoint(rank=self.rank, session_id=session, device=device,
                          pairing=self.listener.pairing if self.listener is not None else "",
                          units=[_address(self.units[n], r) for n, r in self.regions.items()])

    def pair(self, endpoints: list[KVEndpoint], consumer: str = "") -> None:
        """Check and keep the ranks of consumer instance ``consumer`` this producer rank
        writes to; the peers of other consumers stay as they are. Pairing a consumer again
        replaces (and closes) its old peers: nothing may be in flight to them then."""
        if self.role != PRODUCER:
            raise RuntimeError(f"{self.role} ranks do not export KV")
        by_rank = {e.rank: e for e in endpoints}
        peers, p2p_peers = {}, {}
        for cut in self.graph.cuts:
            if cut.producer_rank != self.rank:
                continue
            dest = self.graph.rank(CONSUMER, cut.consumer_rank)
            endpoint = by_rank.get(cut.consumer_rank)
            if endpoint is None:
                raise PairingRefused([Refusal(code=Code.PAIRING_RANK_UNKNOWN,
                                              message=f"no endpoint for consumer rank {dest.label}.",
                                              fix="pair with every rank of the consumer instance.")])
            cut = cut.over(set(self.regions))
            written = {dst for g in cut.groups for _, dst in g.units}
            expected = {u.name: u for u in dest.units if u.name in written}
            refusals = endpoint_refusals(expected, endpoint, dest.label)
            if refusals:
                for made in p2p_peers.values():
                    made.close()
                raise PairingRefused(refusals)
            if self.p2p:
                if cut.groups:
                    try:
                        p2p_peers[cut.consumer_rank] = P2PPeer(
                            address=endpoint.session_id, pairing=endpoint.pairing,
                            consumer_device=endpoint.device, plan=cut,
                            caches=self.caches, dst_block_bytes={u.name: u.bytes_per_block for u in dest.units},
                            producer_rank=self.rank, spec=self.graph.spec.transfer, transport=self.transport)
                    except TransferError as err:  # refused or unreachable: a refusal, the rank lives on
                        for made in p2p_peers.values():
                            made.close()
                        raise PairingRefused([Refusal(
                            code=Code.PAIRING_PEER_FAILED,
                            message=f"producer rank {self.graph.rank(PRODUCER, self.rank).label} could not pair "
                                    f"with consumer rank {dest.label}: {err}",
                            fix="read the consumer rank's reason (or its log, if it closed the connection); check "
                                "that both instances run and that transfer.* agrees on both sides.")]) from err
                continue
            regions = {u.name: UnitRegion(base=u.base, block_bytes=u.block_bytes, num_blocks=u.num_blocks,
                                          chunk_blocks=u.chunk_blocks) for u in endpoint.units}
            peers[cut.consumer_rank] = (endpoint.session_id, regions, cut)
        old = self.consumers.get(consumer)
        self.consumers = {**self.consumers, consumer: ConsumerPeers(direct=peers, p2p=p2p_peers)}
        if old is not None:
            old.close()

    def forget(self, consumer: str) -> bool:
        """Close and drop the peers of consumer instance ``consumer`` (it stopped, or a
        transfer to it failed); other consumers' stay. Nothing may be in flight to them.
        False when this rank held none."""
        old = self.consumers.get(consumer)
        if old is None:
            return False
        self.consumers = {cid: peers for cid, peers in self.consumers.items() if cid != consumer}
        old.close()
        return True

    def paired(self, consumer: str = "") -> bool:
        return consumer in self.consumers

    @property
    def consumer_ranks(self) -> list[int]:
        """The ranks of a consumer instance this rank writes to, the same for every
        consumer of its graph (its sender sends to them all at once)."""
        return self._consumer_ranks

    @property
    def writes_outside_streams(self) -> bool:
        """A direct Mooncake write is read by the engine outside any stream: the host must
        wait for the forward that wrote the KV before one starts."""
        return not self.p2p

    def send(self, consumer_rank: int, job: KVExport) -> int:
        """Write one request's blocks into one rank of the consumer the job names; raises
        if they did not land (or that consumer never paired with this rank). Runs on a lane of
        the sender's thread for that consumer, in its stream, ordered after the forward that wrote them; each
        pair has its own lock, so the consumer ranks are written at once. Returns the
        bytes moved: the cut plan's runs for these blocks."""
        peers = self.consumers.get(job.consumer)
        if peers is None:
            raise TransferError(f"producer rank {self.rank} has not paired with consumer {job.consumer!r}")
        moved = 0
        direct = peers.direct.get(consumer_rank)
        if direct is not None:
            session, regions, cut = direct
            descriptors = block_descriptors(cut, self.regions, regions, job.src_blocks, job.dst_blocks)
            self.transport.write(session, descriptors)
            moved += descriptors.nbytes
        peer = peers.p2p.get(consumer_rank)
        if peer is not None:
            peer.send(job.src_blocks, job.dst_blocks, job.request_id, job.nonce)
            moved += peer.plan.bytes_per_block * len(job.src_blocks)  # what its packs carry
        return moved

    def close(self) -> None:
        for peers in self.consumers.values():
            peers.close()
        if self.listener is not None:
            self.listener.close()
        if self.transport is not None:
            self.transport.close()


def _local_region(unit: UnitSpec, cache: torch.Tensor) -> UnitRegion:
    """A unit's cache as the pairing check sees it (nothing is registered for p2p)."""
    return UnitRegion(base=cache.data_ptr(), block_bytes=unit.bytes_per_block, num_blocks=cache.shape[0])
