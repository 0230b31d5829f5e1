"""CUDA graphs for decode steps on the triton backend: one graph per batch-size bucket.

A decode step of a small model is mostly kernel launches (per layer: norms, projections,
rope, KV write, attention); replaying a captured graph removes the CPU launch cost. Each
bucket owns static input buffers; a step of B sequences is copied into the smallest bucket
>= B, the rest padded as no-ops (slot -1: no KV write; context length 0: the decode
kernel reads nothing and writes zeros). The block table has a fixed width, so longer
tables fall back to eager. Sampling stays outside the graph. Only the triton backend is
captured: its decode launch needs no device->host read (the torch reference loops over
``context_lens.tolist()``, which cannot be captured).
"""

from __future__ import annotations

import torch

from pdflow.attention.metadata import AttentionMetadata

__all__ = ["DecodeGraphRunner", "graph_buckets"]


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (as nano-vllm)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def graphs_supported(model: torch.nn.Module, device: torch.device) -> bool:
    """CUDA device, and every attention layer bound to the triton backend."""
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    return (torch.device(device).type == "cuda" and bool(layers)
            and all(getattr(a.backend, "name", None) == "triton" for a in layers))


class DecodeGraphRunner:
    """``can_run(meta)`` then ``run(ids, positions, meta) -> hidden [B, hidden]``.

    Captures lazily on first use (the KV cache must be bound first), largest bucket first
    so smaller graphs share its memory pool."""

    def __init__(self, model, max_batch: int, block_table_width: int, device,
                 buckets: list[int] | None = None):
        self.model = model
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.width = block_table_width
        self.buckets = sorted(buckets or graph_buckets(max_batch))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        n, dev = self.buckets[-1], self.device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            decode_only=True, slot_mapping=self.slots[:bs], cu_seqlens_q=self.cu[: bs + 1],
            context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        bs = meta.context_lens.shape[0]
        return (meta.decode_only and self.device.type == "cuda" and 0 < bs <= self.max_batch
                and meta.block_tables.shape[1] <= self.width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first); inputs are all padding, so nothing is
        written to the KV cache while warming up."""
        self._reset(self.buckets[-1])
        for bs in reversed(self.buckets):
            args = (self.ids[:bs], self.positions[:bs], self._meta(bs))
            torch.cuda.synchronize(self.device)
            self.model(*args)  # warm-up: triton compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def _reset(self, n: int) -> None:
        self.slots[:n].fill_(-1)
        self.context_lens[:n].zero_()
        self.block_tables[:n].zero_()

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Copy the step into the bucket's buffers, replay, return the first B rows."""
        if not self.graphs:
            self.capture()
        bs = ids.shape[0]
        bucket = next(b for b in self.buckets if b >= bs)
        width = meta.block_tables.shape[1]
        self.ids[:bs].copy_(ids)
        self.positions[:bs].copy_(positions)
        self.slots[:bs].copy_(meta.slot_mapping)
        self.context_lens[:bs].copy_(meta.context_lens)
        self.block_tables[:bs, :width].copy_(meta.block_tables)
        if width < self.width:
            self.block_tables[:bs, width:].zero_()
        if bs < bucket:  # padding rows: no KV write, nothing read
            self.slots[bs:bucket].fill_(-1)
            self.context_lens[bs:bucket].zero_()
        self.graphs[bucket].replay()
        self.replays += 1
        return self.outputs[bucket][:bs]
