"""Shared pieces of the transfer tests: real Mooncake engines (pooled: an engine takes
~1 s to tear down, so the session reuses them), unit caches filled with random bytes or
poison, and a tensor-level oracle of the head cut."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdflow.attention.kv_cache import TORCH_DTYPES
from pdflow.graph.units import UnitSpec
from pdflow.spec import TransferSpec
from pdflow.transfer.grants import kv_nonce, pairing_token
from pdflow.transfer.mooncake_engine import INSTALL_HINT

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

try:
    import mooncake.engine  # noqa: F401
    MOONCAKE_ERROR = None
except ImportError as err:  # a laptop without libibverbs1; CI installs it and must not skip
    if os.environ.get("CI"):
        raise ImportError(f"CI needs the Mooncake Transfer Engine: {INSTALL_HINT}") from err
    MOONCAKE_ERROR = f"Mooncake Transfer Engine unavailable ({err}); {INSTALL_HINT}"

needs_mooncake = pytest.mark.skipif(MOONCAKE_ERROR is not None, reason=MOONCAKE_ERROR or "")
POISON = 0xFF  # every byte: a NaN in any float dtype
_POOL: list = []


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Byte copies on one intra-op thread: on a small, shared machine two spinning OpenMP
    threads per copy (beside the engines' own threads) make these tests ~8x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def transports():
    """``make(spec)`` hands out pooled engines (spec and limits are reset per test);
    each test's registrations are dropped when it ends."""
    from pdflow.transfer.mooncake_engine import REGISTRATION_LIMIT, MooncakeTransport

    used = []

    def make(spec: TransferSpec | None = None):
        spec = spec or TransferSpec(protocol="tcp")
        if len(used) == len(_POOL):
            _POOL.append(MooncakeTransport(spec))
        t = _POOL[len(used)]
        t.spec, t.registration_limit = spec, REGISTRATION_LIMIT
        used.append(t)
        return t

    yield make
    for t in used:
        t.unregister_all()


def caches_for(units, num_blocks: int, *, fill: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """One cache per unit shaped as its UnitSpec: random bytes or all-0xFF poison."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for u in units:
        cache = torch.empty(u.cache_shape(num_blocks), dtype=TORCH_DTYPES[u.dtype])
        raw = cache.view(-1).view(torch.uint8)
        if fill == "random":
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        else:
            raw.fill_(POISON)
        out[u.name] = cache
    return out


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 with its last dim in bytes (element views compare NaN != NaN)."""
    return cache.view(torch.uint8)


def expected_consumer(graph, producer_caches, consumer_rank: int, dst: UnitSpec, cache: torch.Tensor,
                      src_blocks, dst_blocks) -> torch.Tensor:
    """What the consumer unit must hold: poison everywhere, and in each mapped block its
    own heads, page by page, taken from whichever producer rank holds them. Tensor
    indexing over cache_shape [blocks, pages, heads, tokens, dim], no byte arithmetic."""
    src_name = next(r.producer_unit for r in graph.regions if r.consumer_unit == dst.name)
    want = torch.full_like(as_bytes(cache), POISON)
    for h_local, head in enumerate(dst.heads or (None,)):
        rank, src = next((r, u) for r in graph.producer.ranks for u in r.units
                         if u.name == src_name and (head is None or head in u.heads))
        src_cache = as_bytes(producer_caches[rank.rank][src_name])
        s_local = 0 if head is None else src.heads.index(head)
        for sb, db in zip(src_blocks, dst_blocks, strict=True):
            want[db, :, h_local] = src_cache[sb, :, s_local]
    return want


def wrong_units(graph, producer_caches, consumer_caches, requests, *, blocks_only: bool = False) -> list[str]:
    """Consumer units (rank:name) whose bytes differ from the oracle after ``requests``
    (list of (src_blocks, dst_blocks)) moved; ``blocks_only`` checks just their blocks,
    not that every other block kept its poison."""
    bad = []
    for rank in graph.consumer.ranks:
        for unit in rank.units:
            if unit.name not in consumer_caches.get(rank.rank, {}):
                continue
            got = as_bytes(consumer_caches[rank.rank][unit.name])
            want = got.clone() if blocks_only else torch.full_like(got, POISON)
            for src_blocks, dst_blocks in requests:
                one = expected_consumer(graph, producer_caches, rank.rank, unit, got, src_blocks, dst_blocks)
                want[list(dst_blocks)] = one[list(dst_blocks)]
            if not torch.equal(got, want):
                bad.append(f"{rank.label}:{unit.name}")
    return bad


def producer_caches_of(graph, num_blocks: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every producer rank's caches: random bytes, seeded by rank (any process rebuilds them)."""
    return {r.rank: caches_for(r.units, num_blocks, fill="random", seed=r.rank + 1) for r in graph.producer.ranks}


# The pairing key the tests' listeners hold (``transfer.grants``), its token, and a send
# with the nonce the consumer's owner would grant.
KEY = bytes(range(32))
PAIRING = pairing_token(KEY)


def send(peer, src_blocks, dst_blocks, request_id: str = "r") -> None:
    peer.send(src_blocks, dst_blocks, request_id, kv_nonce(KEY, dst_blocks))


def sessions_end(listeners, timeout_s: float = 30.0) -> bool:
    """Whether every consumer rank's listener has no pair session left (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while any(listener._sessions for listener in listeners):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
