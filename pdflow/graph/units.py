"""KV units: one field of one layer row for one block, and where its bytes lie.

Layout inside one block of a unit (see docs/ARCHITECTURE.md, 'KV units, pages and the
head cut'): page-major, then head-major within a page, then tokens, then head_dim. So
head ``h`` (local index) of page ``p`` is one contiguous run of
``page_tokens * head_dim * itemsize`` bytes at
``((p * H_local) + h) * page_tokens * head_dim * itemsize``. A cache tensor for one unit
is therefore ``[num_blocks, block_size // page_tokens, H_local, page_tokens, head_dim]``
(an fp8 V unit holds each head page transposed inside the same run: the kernels' business,
not the cut's).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.spec.dtypes import dtype_bytes

# Families of units; "idx" units hold one headless key per token (sparse-attention indexer).
TARGET, DRAFT, INDEXER = "mha", "draft", "idx"


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """A contiguous byte range inside one block."""

    offset: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitSpec:
    family: str
    field: str
    # Global layer for target/indexer units, drafter row for draft units.
    layer: int
    # Global KV head ids held by this rank, ascending and contiguous; () for headless.
    heads: tuple[int, ...]
    head_dim: int
    dtype: str
    # None only when the binding failed to declare one (refused by validate()).
    page_tokens: int | None
    block_size: int

    @property
    def geometry(self) -> str:
        return f"{self.dtype}_d{self.head_dim}"

    @property
    def name(self) -> str:
        return f"{self.family}.{self.geometry}.{self.field}.layer_{self.layer}"

    @property
    def itemsize(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def local_heads(self) -> int:
        """Head slots per page (1 for a headless unit)."""
        return max(1, len(self.heads))

    @property
    def pages_per_block(self) -> int:
        assert self.page_tokens is not None, f"{self.name} has no declared page"
        return self.block_size // self.page_tokens

    @property
    def span(self) -> int:
        """Bytes of one head of one page."""
        assert self.page_tokens is not None, f"{self.name} has no declared page"
        return self.page_tokens * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.local_heads * self.head_dim * self.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of the cache tensor that binds this unit (see module docstring)."""
        assert self.page_tokens is not None, f"{self.name} has no declared page"
        return (num_blocks, self.pages_per_block, self.local_heads, self.page_tokens, self.head_dim)

    def local_index(self, head: int) -> int:
        if not self.heads:
            raise ValueError(f"{self.name} is headless")
        return self.heads.index(head)

    def head_major_runs(self, heads: range | tuple[int, ...]) -> list[Run]:
        """The runs inside one block that hold a contiguous range of this rank's heads:
        one run per page."""
        heads = tuple(heads)
        if not self.heads:
            return [Run(offset=0, length=self.bytes_per_block)]
        first = self.local_index(heads[0])
        if tuple(self.heads[first : first + len(heads)]) != heads:
            raise ValueError(f"heads {heads} are not a contiguous range held by {self.name}")
        span, per_page = self.span, self.local_heads
        return [
            Run(offset=((p * per_page) + first) * span, length=len(heads) * span)
            for p in range(self.pages_per_block)
        ]
