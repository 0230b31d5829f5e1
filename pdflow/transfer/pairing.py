"""Pairing: a producer rank checks a consumer rank's ``Hello`` against its own plan.

A mismatch is refused here, with the graph's refusal code, before any byte is written:
refused inside a transfer, it would leave the consumer waiting on a request that can
never be served. The producer's cut plan was computed for the consumer units the graph
placed; the consumer's published units must be exactly those (matched by name, ignoring
geometry so that a dtype or head_dim change is named, not reported as missing), and
every published region must be able to hold its unit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pdflow.graph.refusals import Code, Refusal
from pdflow.graph.regions import slot_key, unit_mismatches
from pdflow.graph.run_graph import RunGraph
from pdflow.transfer.channel import Endpoint
from pdflow.transfer.errors import PairingRefused, TransferError
from pdflow.transfer.messages import Hello, Paired


def check_hello(graph: RunGraph, producer_rank: int, hello: Hello) -> list[Refusal]:
    """Every reason to refuse ``hello`` from the producer rank's point of view."""
    consumer = graph.instance("decode").ranks
    if not 0 <= hello.rank < len(consumer):
        return [Refusal(code=Code.PAIRING_RANK_UNKNOWN,
                        message=f"consumer rank {hello.rank} of {hello.instance} is not one of the "
                        f"graph's {len(consumer)} decode ranks.",
                        fix="pair consumer and producer instances built from the same run graph.")]
    cut = graph.cut(producer_rank, hello.rank)
    refusals: list[Refusal] = []
    if graph.spec.transfer.staging and hello.receive is None:
        refusals.append(Refusal(code=Code.PAIRING_REGION_INVALID,
                                message=f"consumer rank {hello.rank} published no receive area, and "
                                "transfer.staging packs the producer's writes into one.",
                                fix="build both sides from the same transfer spec."))
    if cut is None:
        return refusals  # this producer rank owes that consumer rank nothing
    published = {slot_key(u.name): u for u in hello.units}
    expected = consumer[hello.rank]
    for dst_name in sorted({dst for group in cut.groups for _, dst in group.units}):
        want = expected.unit(dst_name)
        got = published.get(slot_key(dst_name))
        if got is None:
            refusals.append(Refusal(code=Code.REGION_MISSING,
                                    message=f"consumer rank {hello.rank} publishes no unit {dst_name}.",
                                    fix="make the consumer bind every unit `pdflow plan` lists for it."))
            continue
        pair = f"consumer rank {hello.rank} unit {got.name} (the plan expects {dst_name})"
        refusals += unit_mismatches(want, got, pair=pair)
        refusals += _region_refusals(hello, got)
    return refusals


def _region_refusals(hello: Hello, unit) -> list[Refusal]:
    region = hello.regions.get(unit.name)
    problem = None
    if region is None:
        problem = "has no published region"
    elif region.block_bytes != unit.bytes_per_block:
        problem = f"has {region.block_bytes} bytes per block, its unit {unit.bytes_per_block}"
    elif region.num_blocks < 1 or region.base <= 0 or region.chunk_blocks < 0:
        problem = f"is empty or malformed ({region})"
    if problem is None:
        return []
    return [Refusal(code=Code.PAIRING_REGION_INVALID,
                    message=f"consumer rank {hello.rank} unit {unit.name} {problem}.",
                    fix="publish each unit's cache as registered (KVImporter.hello).")]


def pair_with_producers(endpoint: Endpoint, hello: Hello, producers: Mapping[int, str], *,
                        timeout_s: float) -> None:
    """Consumer side: send ``hello`` to every producer rank (rank -> side-channel address)
    and wait for all answers; raises ``PairingRefused`` with every refusal, or
    ``TransferError`` when a producer does not answer in time. Call it before any request
    is in flight: other messages arriving meanwhile are dropped."""
    for address in producers.values():
        endpoint.send(address, hello)
    waiting, refusals = set(producers), []
    deadline = time.monotonic() + timeout_s
    while waiting:
        message = endpoint.recv(max(0.0, deadline - time.monotonic()))
        if message is None:
            raise TransferError(f"producer ranks {sorted(waiting)} did not answer pairing within {timeout_s} s")
        if (isinstance(message, Paired) and message.instance == hello.instance
                and message.consumer_rank == hello.rank and message.producer_rank in waiting):
            waiting.discard(message.producer_rank)
            refusals += message.refusals
    if refusals:
        raise PairingRefused(refusals)
