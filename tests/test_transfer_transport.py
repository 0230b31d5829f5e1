"""The hardened Mooncake transport over real TCP loopback: registrations in chunks of
whole blocks that descriptors never cross, descriptor batches capped per call, retries
of a transient failure, a persistent failure raised after its retries, and our own
deadline on a peer that never answers."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import transfer_kit
from transfer_kit import needs_mooncake

from pdflow.graph.units import UnitSpec
from pdflow.spec import TransferSpec
from pdflow.transfer.descriptors import Descriptors, UnitRegion, block_descriptors
from pdflow.transfer.errors import TransferError

pytestmark = needs_mooncake
transports = transfer_kit.transports  # the pooled-engine fixture
one_torch_thread = transfer_kit.one_torch_thread

UNIT = UnitSpec(family="mha", field="k", layer=0, heads=(0,), head_dim=16, dtype="fp32", page_tokens=16,
                block_size=32)


def spec(**kw) -> TransferSpec:
    return TransferSpec(protocol="tcp", **{"retries": 0, "timeout_s": 10.0, **kw})


def random_cache(blocks: int) -> torch.Tensor:
    return torch.randn(UNIT.cache_shape(blocks))


def test_caches_register_in_block_chunks_and_descriptors_stay_inside_one(graph_of, transports):
    """A cache of 7 blocks registered 3 blocks per chunk; blocks 0..6 -> 0..6 contiguous on
    both sides. Merged across chunks, Mooncake refuses the write (the wrong version);
    split at chunk edges, every byte lands."""
    graph = graph_of("prefill=tp4", "decode=tp4", "prefill.block_size=32", "decode.block_size=32",
                     "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16", "drafter=none")
    cut = graph.cut(0, 0)
    unit = graph.consumer.ranks[0].units[0]
    name = unit.name
    cut = type(cut)(producer_rank=0, consumer_rank=0,
                    groups=tuple(type(g)(units=((name, name),), runs=g.runs) for g in cut.groups
                                 if (name, name) in g.units))
    a, b = transports(spec()), transports(spec())
    a.registration_limit = b.registration_limit = 3 * unit.bytes_per_block + 100
    src = torch.randn(unit.cache_shape(7))
    dst = torch.full(unit.cache_shape(7), float("nan"))
    src_region, dst_region = a.register_unit(unit, src), b.register_unit(unit, dst)
    assert src_region.chunk_blocks == dst_region.chunk_blocks == 3
    assert len(b._registered[dst_region.base]) == 3  # 3 + 3 + 1 blocks

    blocks = list(range(7))
    merged = block_descriptors(cut, {name: UnitRegion(base=src_region.base, block_bytes=unit.bytes_per_block,
                                                      num_blocks=7)},
                               {name: UnitRegion(base=dst_region.base, block_bytes=unit.bytes_per_block,
                                                 num_blocks=7)}, blocks, blocks)
    assert len(merged) == 1
    with pytest.raises(TransferError):
        a.write(b.session_id, merged)

    split = block_descriptors(cut, {name: src_region}, {name: dst_region}, blocks, blocks)
    assert len(split) == 3
    a.write(b.session_id, split)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


def test_a_registration_limit_below_one_block_is_refused(transports):
    t = transports(spec())
    t.registration_limit = UNIT.bytes_per_block - 1
    with pytest.raises(ValueError, match="does not fit one registration"):
        t.register_unit(UNIT, random_cache(2))


def test_descriptors_go_out_in_batches_of_descriptor_batch(transports):
    a, b = transports(spec(descriptor_batch=4)), transports(spec())
    src, dst = torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    a.register(src)
    b.register(dst)
    desc = Descriptors()
    for i in range(10):  # every other element: nothing merges
        desc.add(src.data_ptr() + 16 * i, dst.data_ptr() + 16 * i, 8)
    before = a.stats.calls
    a.write(b.session_id, desc)
    assert a.stats.calls - before == 3
    assert torch.equal(dst[0:20:2], src[0:20:2]) and not dst[1:20:2].any()


def test_a_transient_failure_is_retried(transports):
    """The consumer registers its buffer 150 ms after the first attempt: without retries
    the write fails; with backoff 0.1, 0.2, 0.4 s it lands."""
    a, b = transports(spec(retries=0)), transports(spec())
    src = torch.arange(256, dtype=torch.int32)
    a.register(src)
    desc = Descriptors()

    for retries in (0, 3):
        dst = torch.zeros(256, dtype=torch.int32)
        desc = Descriptors()
        desc.add(src.data_ptr(), dst.data_ptr(), 1024)
        a.spec = spec(retries=retries, retry_backoff_s=0.1)
        timer = threading.Timer(0.15, b.register, args=(dst,))
        timer.start()
        failures = a.stats.failures
        try:
            if retries == 0:
                with pytest.raises(TransferError, match="returned -1 1 times"):
                    a.write(b.session_id, desc)
            else:
                a.write(b.session_id, desc)
                assert torch.equal(dst, src)
                assert a.stats.failures > failures
        finally:
            timer.join()
            b.unregister(dst.data_ptr())


def test_a_persistent_failure_raises_after_its_retries(transports):
    a, b = transports(spec(retries=2, retry_backoff_s=0.01)), transports(spec())
    src = torch.zeros(16, dtype=torch.int32)
    a.register(src)
    desc = Descriptors()
    desc.add(src.data_ptr(), 12345678, 64)  # not inside anything b registered
    calls = a.stats.calls
    with pytest.raises(TransferError, match="returned -1 3 times"):
        a.write(b.session_id, desc)
    assert a.stats.calls - calls == 3
    with pytest.raises(TransferError):
        a.write("127.0.0.1:1", desc)  # nobody listens there


def test_a_peer_that_never_answers_fails_by_our_deadline(transports):
    """A socket that accepts connections but never speaks holds Mooncake's handshake for
    ~61 s (and the engine's other writes with it); our deadline ends the write after 1 s,
    and once that peer is gone the engine serves others again."""
    a, b = transports(spec(timeout_s=1.0)), transports(spec())
    src, dst = torch.arange(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    a.register(src)
    b.register(dst)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    desc = Descriptors()
    desc.add(src.data_ptr(), dst.data_ptr(), 64)
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="deadline"):
            a.write(f"127.0.0.1:{mute.getsockname()[1]}", desc)
        assert time.monotonic() - start < 15  # far below the engine's own ~61 s
    finally:
        mute.close()  # resets the held connection: the stuck lane returns
    a.spec = spec(timeout_s=10.0)
    a.write(b.session_id, desc)
    assert torch.equal(dst, src)
