"""From the graph's per-block cut plan (``CutPlan``) to the byte descriptors a transfer
engine moves. Only addresses are added here (cache bases, block indices, run offsets; the
graph alone computes layouts), and descriptors contiguous on both sides inside one
registered chunk are merged. No torch, no engine: tested on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdflow.graph.cut import CutPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitRegion:
    """Where one unit's cache lives in a rank's memory: block b starts at
    ``base + b * block_bytes``. The cache is registered with the engine in chunks of
    ``chunk_blocks`` blocks (each under 2 GiB); a descriptor must stay inside one."""

    base: int
    block_bytes: int
    num_blocks: int
    chunk_blocks: int = 0  # 0: the whole cache is one chunk

    def chunk(self, index: int) -> int:
        return index // self.chunk_blocks if self.chunk_blocks else 0

    def block(self, index: int) -> int:
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} is outside this cache's {self.num_blocks} blocks")
        return self.base + index * self.block_bytes


@dataclass(kw_only=True, slots=True)
class Descriptors:
    """Parallel lists of source address, destination address and length, in bytes."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    last_key: object = None

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return sum(self.length)

    def add(self, src: int, dst: int, length: int, key: object = None) -> None:
        """Append, extending the last descriptor when this one continues it on both sides
        and carries the same ``key`` (the registered chunks it lies in)."""
        if (self.length and key == self.last_key and self.src[-1] + self.length[-1] == src
                and self.dst[-1] + self.length[-1] == dst):
            self.length[-1] += length
        else:
            self.src.append(src)
            self.dst.append(dst)
            self.length.append(length)
            self.last_key = key

    def batches(self, size: int):
        """(src, dst, length) slices of at most ``size`` descriptors each."""
        for i in range(0, len(self), size):
            yield self.src[i : i + size], self.dst[i : i + size], self.length[i : i + size]


def block_descriptors(
    plan: CutPlan,
    src_units: Mapping[str, UnitRegion],
    dst_units: Mapping[str, UnitRegion],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> Descriptors:
    """Descriptors moving blocks ``src_blocks[i]`` of the producer rank to blocks
    ``dst_blocks[i]`` of the consumer rank, for every unit pair and run of ``plan``."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} producer blocks for {len(dst_blocks)} consumer blocks")
    out = Descriptors()
    for group in plan.groups:
        for src_name, dst_name in group.units:
            src, dst = src_units[src_name], dst_units[dst_name]
            for sb, db in zip(src_blocks, dst_blocks, strict=True):
                s0, d0 = src.block(sb), dst.block(db)
                key = (src_name, src.chunk(sb), dst_name, dst.chunk(db))
                for run in group.runs:
                    out.add(s0 + run.src, d0 + run.dst, run.length, key)
    return out
