"""Packed staging: one request's cut runs for one consumer rank, in one buffer.

Why: over TCP each descriptor costs ~32 us whatever its length, so a head cut sent as raw
runs crawls. The producer gathers the runs into one buffer, moves it in large writes,
and the consumer scatters it. The packed order is the direct path's descriptor order
(group, unit pair, block, run): every path leaves byte-identical caches. Pure torch on
byte views (the pairs' ``copy_chunk`` runs ``copy_piece`` on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdflow.graph.cut import CutGroup, CutPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Blocks ``blocks[start:stop]`` of one unit pair, at ``offset`` in the packed stream."""

    group: int
    src_unit: str
    dst_unit: str
    start: int
    stop: int
    offset: int
    nbytes: int


def packed_nbytes(plan: CutPlan, num_blocks: int) -> int:
    return plan.bytes_per_block * num_blocks


def pieces(plan: CutPlan, num_blocks: int, max_bytes: int | None = None) -> list[Piece]:
    """The packed stream of ``num_blocks`` blocks, in order, cut into pieces of whole
    blocks of at most ``max_bytes`` each (one unit pair per piece)."""
    out: list[Piece] = []
    offset = 0
    for g, group in enumerate(plan.groups):
        per_block = group.bytes_per_unit
        if max_bytes is not None and per_block > max_bytes:
            raise ValueError(f"one block's runs ({per_block} bytes) exceed the {max_bytes}-byte staging buffer")
        step = num_blocks if max_bytes is None else max(1, max_bytes // per_block)
        for src, dst in group.units:
            for start in range(0, num_blocks, step):
                stop = min(num_blocks, start + step)
                out.append(Piece(group=g, src_unit=src, dst_unit=dst, start=start, stop=stop,
                                 offset=offset, nbytes=(stop - start) * per_block))
                offset += (stop - start) * per_block
    return out


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def byte_rows(buf: torch.Tensor, grain: int) -> torch.Tensor:
    """``buf``'s bytes as rows of ``grain`` bytes, in the widest integer word that divides
    ``grain`` (no copy; refuses a strided tensor). Byte-wide index_copy_ runs ~20x
    slower than word-wide on CPU."""
    if not buf.is_contiguous():
        raise ValueError("KV caches must be contiguous to be packed or registered")
    size, word = next(w for w in _WORDS if grain % w[0] == 0)
    return buf.view(-1).view(torch.uint8).view(word).view(-1, grain // size)


def block_bytes(cache: torch.Tensor) -> int:
    return cache.numel() * cache.element_size() // cache.shape[0]


def _grain(group: CutGroup, src_block: int, dst_block: int) -> int:
    """The largest byte count that divides every run offset and length and both block sizes."""
    return math.gcd(src_block, dst_block, *(v for r in group.runs for v in (r.src, r.dst, r.length)))


def _rows(group: CutGroup, side: str, grain: int) -> torch.Tensor:
    return torch.cat([torch.arange(getattr(r, side) // grain, (getattr(r, side) + r.length) // grain)
                      for r in group.runs])


def _index(rows: torch.Tensor, blocks: Sequence[int], per_block: int, device) -> torch.Tensor:
    blk = torch.as_tensor(list(blocks), dtype=torch.int64)
    return (blk[:, None] * per_block + rows[None, :]).reshape(-1).to(device)


def copy_piece(plan: CutPlan, piece: Piece, cache: torch.Tensor, blocks: Sequence[int], packed: torch.Tensor,
               *, other_block_bytes: int, reverse: bool) -> None:
    """Gather ``piece`` from the producer's ``cache`` into ``packed`` (``piece.nbytes``
    uint8), or (``reverse``) scatter it from there into the consumer's ``cache``."""
    group = plan.groups[piece.group]
    grain = _grain(group, block_bytes(cache), other_block_bytes)
    rows = _rows(group, "dst" if reverse else "src", grain)
    idx = _index(rows, blocks[piece.start:piece.stop], block_bytes(cache) // grain, cache.device)
    if reverse:
        byte_rows(cache, grain).index_copy_(0, idx, byte_rows(packed, grain))
    else:
        torch.index_select(byte_rows(cache, grain), 0, idx, out=byte_rows(packed, grain))
