"""A cut plan's packed stream (``packing``'s order) as copy rows for ``pdflow.kernels``:
per row, the address on this rank's side, its offset in the stream, its length in words.

``plan``/``ids`` feed ``copy_plan``, which computes every row in the kernel from
per-group constants and the request's block ids (the pairs' pack and scatter).
``rows`` materializes them for a producer writing straight into a consumer's caches, in a
device table kept per request length (a request writes only its addresses, one op per
group). Why: the host-built, per-chunk tables this replaced cost 2-9 ms a chunk against a
0.1 ms copy.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pdflow.graph.cut import CutPlan
from pdflow.transfer.packing import Piece, block_bytes

# Bytes per element ``pdflow.kernels.copy_runs`` copies (its WORD; not imported here, so
# importing pdflow loads no Triton: the interpreter must be chosen before triton.language
# is first imported).
WORD = 8
TEMPLATES = 8  # request lengths whose row tables a RunTable keeps


class RunTable:
    def __init__(self, plan: CutPlan, caches: Mapping[str, torch.Tensor], side: str,
                 device: torch.device | None = None):
        """``side``: "src" (a producer's caches, the plan's source units) or "dst";
        ``device``: where the rows live (the launching GPU; default: the caches')."""
        self.device = device or next(iter(caches.values())).device
        # Per group, what does not depend on the request: each (unit, run)'s address in
        # block 0, each unit's block stride, each run's length and offset in a block's
        # packed runs; then a request's addresses are one broadcast op per group.
        self.groups = []
        self.unit_index: list[dict[tuple[str, str], int]] = []
        for group in plan.groups:
            names = [s if side == "src" else d for s, d in group.units]
            if any(v % WORD for r in group.runs for v in (r.src, r.dst, r.length)):
                raise ValueError(f"cut runs must be multiples of {WORD} bytes to be copied by word")

            def on_device(values):
                return torch.tensor(values, dtype=torch.int64).to(self.device)

            lengths = [r.length for r in group.runs]
            base = on_device([caches[n].data_ptr() for n in names])
            self.groups.append(_Group(
                first_block=(base[:, None] + on_device([getattr(r, side) for r in group.runs])[None, :])[:, None, :],
                stride=on_device([block_bytes(caches[n]) for n in names])[:, None, None],
                words=on_device([n // WORD for n in lengths])[None, None, :],
                prefix=on_device([sum(lengths[:i]) for i in range(len(lengths))])[None, None, :],
                per_block=group.bytes_per_unit, units=len(names), runs=len(lengths)))
            self.unit_index.append({pair: i for i, pair in enumerate(group.units)})
        self.max_words = max((max(r.length for r in g.runs) // WORD for g in plan.groups if g.runs), default=0)
        # For ``copy_plan``: the same per-group constants flat, and the addresses of their
        # arrays (kept alive here), one row per group with runs; the block ids, pinned.
        moving = [g for g in self.groups if g.units and g.runs]
        self._arrays = [[t.reshape(-1).contiguous() for t in (g.first_block, g.stride, g.words, g.prefix)]
                        for g in moving]
        self.plan = torch.tensor([[g.units, g.runs, g.per_block, *(t.data_ptr() for t in arrays)]
                                  for g, arrays in zip(moving, self._arrays, strict=True)],
                                 dtype=torch.int64).reshape(-1, 7).to(self.device)
        self._ids = self._host_ids = torch.zeros(0, dtype=torch.int64)
        # Per request length (the last TEMPLATES lengths: device memory, bounded): the rows
        # with offsets and lengths filled once, the block ids' pinned host copy and device
        # copy. A request rewrites only the addresses.
        self._template = functools.lru_cache(maxsize=TEMPLATES)(self._build_template)

    def compile_copies(self, *, reverse: bool, programs: int, direct: bool = False) -> None:
        """At pairing, compile the copy kernels this side's requests launch (``copy_plan``,
        or ``copy_runs`` for direct peer writes), so the first request does not wait on
        Triton. A failure costs only that wait: it is warned about, not raised."""
        if self.device.type != "cuda":
            return
        try:
            from pdflow.kernels.copy_runs import compile_copies

            compile_copies(self.device, self.max_words, groups=None if direct else self.plan.shape[0],
                           reverse=reverse, programs=programs)
        except Exception as exc:  # speed only: the copies compile at first use instead
            warnings.warn(f"copy kernels compile at the first transfer ({type(exc).__name__}: {str(exc)[:200]})",
                          RuntimeWarning, stacklevel=2)

    def ids(self, blocks: Sequence[int]) -> torch.Tensor:
        """The request's block ids where ``copy_plan`` reads them, on the rows' device: one
        host-to-device copy from pinned memory, the only device op a request adds before
        its first copy (each op on a request's path cost 20-140 us on the GPU host).
        Rewritten by the next request (a pair's requests run one at a time on one stream,
        each synchronized at its end)."""
        k = len(blocks)
        if k > self._ids.numel():
            n = max(k, 2 * self._ids.numel())
            self._host_ids = torch.zeros(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._ids = self._host_ids if self.device.type != "cuda" else torch.zeros(n, dtype=torch.int64,
                                                                                      device=self.device)
        self._host_ids.numpy()[:k] = blocks
        if self._ids is not self._host_ids:
            self._ids[:k].copy_(self._host_ids[:k], non_blocking=True)
        return self._ids

    def rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """int64 [n, 3] on the device: (address, stream offset, words) of every run of these
        blocks, in stream order: this RunTable's buffer for requests of this length,
        rewritten by the next call for the same length. Per request: one host-to-device
        copy of the block ids and one op per group (each eager op costs ~15 us)."""
        k = len(blocks)
        rows, host, dev = self._template(k)
        if k:
            host.numpy()[:] = blocks
            dev.copy_(host, non_blocking=True)
        start = 0
        for g in self.groups:
            n = g.units * k * g.runs
            torch.addcmul(g.first_block, dev.view(1, -1, 1), g.stride, out=rows[start:start + n, 0].view(g.units, k, g.runs))
            start += n
        return rows

    def _build_template(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows for ``k`` blocks with their stream offsets and lengths (addresses to fill)."""
        offs, words, start = [], [], 0
        for g in self.groups:
            pairs = torch.arange(g.units * k, dtype=torch.int64, device=self.device).view(g.units, k, 1)
            offs.append(torch.add(g.prefix + start, pairs, alpha=g.per_block).view(-1))
            words.append(g.words.expand(g.units, k, g.runs).reshape(-1))
            start += g.units * k * g.per_block
        empty = torch.empty(0, dtype=torch.int64, device=self.device)  # a plan without groups
        offs, words = torch.cat([empty, *offs]), torch.cat([empty, *words])
        rows = torch.stack([torch.zeros_like(offs), offs, words], 1)
        host = torch.zeros(k, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return rows, host, torch.zeros(k, dtype=torch.int64, device=self.device)

    def span(self, chunk: list[Piece], num_blocks: int) -> tuple[int, int]:
        """The rows [first, stop) of a chunk of whole pieces of a ``num_blocks`` request."""

        def row(piece: Piece, block: int) -> int:
            before = sum(g.units * num_blocks * g.runs for g in self.groups[:piece.group])
            unit = self.unit_index[piece.group][(piece.src_unit, piece.dst_unit)]
            return before + (unit * num_blocks + block) * self.groups[piece.group].runs

        return row(chunk[0], chunk[0].start), row(chunk[-1], chunk[-1].stop)


@dataclass(kw_only=True, slots=True)
class _Group:
    first_block: torch.Tensor  # [units, 1, runs]: each run's address in block 0
    stride: torch.Tensor  # [units, 1, 1]: bytes per block of each unit's cache
    words: torch.Tensor  # [1, 1, runs]
    prefix: torch.Tensor  # [1, 1, runs]: each run's offset in one block's packed runs
    per_block: int
    units: int
    runs: int


def direct_rows(src: RunTable, src_blocks: Sequence[int], dst: RunTable, dst_blocks: Sequence[int]) -> torch.Tensor:
    """Rows copying cache to cache (address, address, words), for a producer writing into
    mapped consumer caches: both tables over the same plan, so their runs pair in order."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    a, b = src.rows(src_blocks), dst.rows(dst_blocks)
    return torch.stack([a[:, 0], b[:, 0], a[:, 2]], 1)
