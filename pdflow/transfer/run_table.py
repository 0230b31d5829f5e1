"""A cut plan's packed stream as copy rows, for ``pdflow.kernels.copy_runs``.

The packed order is ``packing``'s (group, unit pair, block, run), so a buffer packed from
these rows is byte-identical to ``packing.pack``'s. For each row: the address on this
rank's side (a producer cache's run, or a consumer cache's), its offset in the stream, and
its length in words. A request's rows are built once, on the caches' device, with a few
vectorised ops per group; a chunk of the stream (whole pieces) is a contiguous slice of
them whose bounds come from the plan's arithmetic on the host, so no chunk rebuilds or
moves a table (the host-built, per-chunk tables this replaced cost 2-9 ms a chunk at page
16 against a 0.1 ms copy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pdflow.graph.cut import CutPlan
from pdflow.transfer.packing import Piece, block_bytes

# Bytes per element ``pdflow.kernels.copy_runs`` copies (its WORD; not imported here, so
# importing pdflow loads no Triton: the interpreter must be chosen before triton.language
# is first imported).
WORD = 8


class RunTable:
    def __init__(self, plan: CutPlan, caches: Mapping[str, torch.Tensor], side: str,
                 device: torch.device | None = None):
        """``side``: "src" (a producer's caches, the plan's source units) or "dst";
        ``device``: where the rows live (the launching GPU; default: the caches')."""
        self.device = device or next(iter(caches.values())).device
        self.groups = []
        self.unit_index: list[dict[tuple[str, str], int]] = []
        for group in plan.groups:
            names = [s if side == "src" else d for s, d in group.units]
            if any(v % WORD for r in group.runs for v in (r.src, r.dst, r.length)):
                raise ValueError(f"cut runs must be multiples of {WORD} bytes to be copied by word")

            def on_device(values):
                return torch.tensor(values, dtype=torch.int64).to(self.device)

            lengths = [r.length for r in group.runs]
            prefix = [sum(lengths[:i]) for i in range(len(lengths))]
            self.groups.append((
                on_device([caches[n].data_ptr() for n in names]),
                on_device([block_bytes(caches[n]) for n in names]),
                on_device([getattr(r, side) for r in group.runs]),
                on_device([n // WORD for n in lengths]), on_device(prefix), sum(lengths), len(lengths)))
            self.unit_index.append({pair: i for i, pair in enumerate(group.units)})
        self.max_words = max((max(r.length for r in g.runs) // WORD for g in plan.groups if g.runs), default=0)

    def rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """int64 [n, 3] on the caches' device: (address, stream offset, words) of every run
        of these blocks, in stream order."""
        blk = torch.tensor(list(blocks), dtype=torch.int64).to(self.device, non_blocking=True)
        k = len(blocks)
        parts = []
        start = 0
        for base, per_unit_block, run_at, words, prefix, per_block, _ in self.groups:
            u = len(base)
            addr = base[:, None, None] + blk[None, :, None] * per_unit_block[:, None, None] + run_at[None, None, :]
            unit_at = torch.arange(u, device=self.device)[:, None, None] * (k * per_block)
            block_at = torch.arange(k, device=self.device)[None, :, None] * per_block
            off = start + unit_at + block_at + prefix[None, None, :]
            parts.append(torch.stack([addr.expand(u, k, -1), off.expand(u, k, -1), words.expand(u, k, -1)], -1)
                         .reshape(-1, 3))
            start += u * k * per_block
        return torch.cat(parts) if parts else torch.empty(0, 3, dtype=torch.int64, device=self.device)

    def span(self, chunk: list[Piece], num_blocks: int) -> tuple[int, int]:
        """The rows [first, stop) of a chunk of whole pieces of a ``num_blocks`` request."""

        def row(piece: Piece, block: int) -> int:
            before = sum(len(self.unit_index[g]) * num_blocks * self.groups[g][6] for g in range(piece.group))
            unit = self.unit_index[piece.group][(piece.src_unit, piece.dst_unit)]
            return before + (unit * num_blocks + block) * self.groups[piece.group][6]

        return row(chunk[0], chunk[0].start), row(chunk[-1], chunk[-1].stop)


def direct_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Rows copying cache to cache: the source rows' addresses to the destination rows'
    (both in stream order, over the same plan), for a producer writing into mapped
    consumer caches."""
    if src.shape != dst.shape:
        raise ValueError(f"source rows {tuple(src.shape)} and destination rows {tuple(dst.shape)} differ")
    return torch.stack([src[:, 0], dst[:, 0], src[:, 2]], 1)
