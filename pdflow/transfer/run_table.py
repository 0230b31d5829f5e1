"""A cut plan's packed stream as copy entries, for ``pdflow.kernels.copy_runs``.

The packed order is ``packing``'s (group, unit pair, block, run), so a buffer packed from
these entries is byte-identical to ``packing.pack``'s. For each entry: the address on
this rank's side (a producer cache's run, or a consumer cache's), its offset in the
stream, and its length. Built per request with a few vectorised ops per group, not one
per run; a chunk of the stream (whole pieces) is the entries whose offset falls inside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pdflow.graph.cut import CutPlan
from pdflow.transfer.packing import block_bytes

# Bytes per element ``pdflow.kernels.copy_runs`` copies (its WORD; not imported here, so
# importing pdflow loads no Triton: the interpreter must be chosen before triton.language
# is first imported).
WORD = 8


class RunTable:
    def __init__(self, plan: CutPlan, caches: Mapping[str, torch.Tensor], side: str):
        """``side``: "src" (a producer's caches, the plan's source units) or "dst"."""
        self.groups = []
        for group in plan.groups:
            names = [s if side == "src" else d for s, d in group.units]
            lengths = torch.tensor([r.length for r in group.runs], dtype=torch.int64)
            if any(v % WORD for r in group.runs for v in (r.src, r.dst, r.length)):
                raise ValueError(f"cut runs must be multiples of {WORD} bytes to be copied by word")
            self.groups.append((
                torch.tensor([caches[n].data_ptr() for n in names], dtype=torch.int64),
                torch.tensor([block_bytes(caches[n]) for n in names], dtype=torch.int64),
                torch.tensor([getattr(r, side) for r in group.runs], dtype=torch.int64),
                lengths, torch.cumsum(lengths, 0) - lengths, int(lengths.sum())))
        self.max_words = max((int(g[3].max()) // WORD for g in self.groups if len(g[3])), default=0)

    def entries(self, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(address, stream offset, length in bytes) of every run of these blocks, in stream order."""
        blk = torch.as_tensor(list(blocks), dtype=torch.int64)
        k = len(blk)
        addrs, offs, lens = [], [], []
        start = 0
        for base, per_unit_block, run_at, lengths, prefix, per_block in self.groups:
            u = len(base)
            addrs.append((base[:, None, None] + blk[None, :, None] * per_unit_block[:, None, None]
                          + run_at[None, None, :]).reshape(-1))
            offs.append((start + torch.arange(u)[:, None, None] * (k * per_block)
                         + torch.arange(k)[None, :, None] * per_block + prefix[None, None, :]).reshape(-1))
            lens.append(lengths.expand(u, k, -1).reshape(-1))
            start += u * k * per_block
        return torch.cat(addrs), torch.cat(offs), torch.cat(lens)


def chunk_table(entries, lo: int, hi: int, buffer_address: int, *, into_buffer: bool) -> torch.Tensor:
    """The copy table of stream bytes [lo, hi) against a buffer holding them from offset 0:
    cache -> buffer (pack) or buffer -> cache (scatter). int64 [n, 3], on the host."""
    addr, off, length = entries
    keep = (off >= lo) & (off < hi)
    at = buffer_address + off[keep] - lo
    src, dst = (addr[keep], at) if into_buffer else (at, addr[keep])
    return torch.stack([src, dst, length[keep] // WORD], 1)
