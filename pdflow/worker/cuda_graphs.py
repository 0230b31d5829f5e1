"""CUDA graphs for decode steps on the triton backend: one graph per batch-size bucket.

A decode step of a small model is mostly kernel launches (per layer: norms, projections,
rope, KV write, attention); replaying a captured graph removes the CPU launch cost. Every
stage captures its own part of the step: the first stage from token ids, later stages
from the hidden states (and relayed drafter taps) they receive, so TP and PP ranks replay
like a single process does. TP collectives inside the stage are captured with it; the PP
send/recv and sampling stay outside.

Each bucket owns static input buffers; a step of B sequences is copied into the smallest
bucket >= B, the rest padded as no-ops (slot -1: no KV write; context length 0: the decode
kernel reads nothing and writes zeros). The block table has a fixed width, so longer
tables fall back to eager. Only the triton backend is captured: its decode launch needs
no device->host read (the torch reference loops over ``context_lens.tolist()``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdflow.attention.metadata import AttentionMetadata
from pdflow.worker.stage_runner import StageRunner

__all__ = ["BucketGraphs", "DecodeGraphRunner", "graph_buckets", "graphs_supported"]


class BucketGraphs:
    """One CUDA graph per batch bucket over a runner's static buffers, captured largest
    first into one memory pool (the smaller graphs reuse the largest's), each after a
    warm-up call outside the capture (Triton compiles, NCCL connects there)."""

    def __init__(self):
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        self.pool = None

    def capture(self, buckets: list[int], device: torch.device, prepare: Callable[[int], Callable[[], object]]) -> None:
        """``prepare(bs)`` fills bucket ``bs``'s static inputs and returns the call to capture."""
        # A capture stream of this device: torch.cuda.graph's default one is made once per
        # process, on whichever GPU first captured, and a second GPU's kernels cannot be
        # captured on it (two in-process instances on two GPUs).
        stream = torch.cuda.Stream(device)
        for bs in sorted(buckets, reverse=True):
            step = prepare(bs)
            torch.cuda.synchronize(device)
            step()  # warm-up, outside the capture
            graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread may query events while we capture.
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs[bs] = step()
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)

    def replay(self, bs: int):
        """Replay bucket ``bs``; its output buffers (read them before the next replay)."""
        self.graphs[bs].replay()
        return self.outputs[bs]

    def release(self) -> None:
        """Drop the graphs and their memory pool."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (as nano-vllm)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def graphs_supported(model: torch.nn.Module, device: torch.device) -> bool:
    """CUDA device, and every attention layer bound to the triton backend."""
    layers = model.attention_layers()
    return (torch.device(device).type == "cuda" and bool(layers)
            and all(getattr(a.backend, "name", None) == "triton" for a in layers))


class DecodeGraphRunner:
    """``can_run(meta)`` then ``run(inputs, positions, meta, taps_in) -> (hidden, taps)``.

    ``hidden_size`` is None on the first stage (inputs are token ids), else the width of
    the hidden states it receives; ``relayed_in`` is the number of tap rows that come
    with them. Captures lazily on first use (the KV cache must be bound first, and every
    TP peer reaches its first decode step together), largest bucket first so smaller
    graphs share its memory pool."""

    def __init__(
        self, stage: StageRunner, *, max_batch: int, block_table_width: int,
        hidden_size: int | None = None, relayed_in: int = 0, dtype: torch.dtype | None = None,
        buckets: list[int] | None = None,
    ):
        self.stage = stage
        self.device = torch.device(stage.device)
        self.max_batch = max_batch
        self.width = block_table_width
        self.buckets = sorted(buckets or graph_buckets(max_batch))
        self.captured = BucketGraphs()
        n, dev = self.buckets[-1], self.device
        if hidden_size is None:
            self.inputs = torch.zeros(n, dtype=torch.int64, device=dev)
        else:
            self.inputs = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        self.taps_in = (torch.zeros(n, relayed_in * hidden_size, dtype=dtype, device=dev)
                        if relayed_in and hidden_size else None)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.replays = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            decode_only=True, slot_mapping=self.slots[:bs], cu_seqlens_q=self.cu[: bs + 1],
            context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
            max_seqlen_q=1,
        )

    def _args(self, bs: int):
        taps = self.taps_in[:bs] if self.taps_in is not None else None
        return self.inputs[:bs], self.positions[:bs], self._meta(bs), taps

    def can_run(self, meta: AttentionMetadata) -> bool:
        bs = meta.context_lens.shape[0]
        return (meta.decode_only and self.device.type == "cuda" and 0 < bs <= self.max_batch
                and meta.block_tables.shape[1] <= self.width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first); inputs are all padding, so nothing is
        written to the KV cache while warming up."""
        self._reset(self.buckets[-1])

        def prepare(bs: int):
            args = self._args(bs)
            return lambda: self.stage.forward(*args)

        self.captured.capture(self.buckets, self.device, prepare)

    def release(self) -> None:
        """Drop the graphs and their memory pool (the instance is shutting down)."""
        self.captured.release()

    def _reset(self, n: int) -> None:
        self.slots[:n].fill_(-1)
        self.context_lens[:n].zero_()
        self.block_tables[:n].zero_()

    @torch.inference_mode()
    def run(
        self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        taps_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the step into the bucket's buffers, replay, return the first B rows (views
        of the graph's output buffers: use them before the next replay)."""
        if not self.captured.graphs:
            self.capture()
        bs = inputs.shape[0]
        bucket = next(b for b in self.buckets if b >= bs)
        width = meta.block_tables.shape[1]
        self.inputs[:bs].copy_(inputs)
        if self.taps_in is not None:
            self.taps_in[:bs].copy_(taps_in)
        self.positions[:bs].copy_(positions)
        self.slots[:bs].copy_(meta.slot_mapping)
        self.context_lens[:bs].copy_(meta.context_lens)
        self.block_tables[:bs, :width].copy_(meta.block_tables)
        if width < self.width:
            self.block_tables[:bs, width:].zero_()
        if bs < bucket:  # padding rows: no KV write, nothing read
            self.slots[bs:bucket].fill_(-1)
            self.context_lens[bs:bucket].zero_()
        hidden, taps = self.captured.replay(bucket)
        self.replays += 1
        return hidden[:bs], (taps[:bs] if taps is not None else None)
