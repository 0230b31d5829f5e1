"""Prefill and mixed steps as CUDA graphs cut at the attention calls (piecewise graphs).

Why: an eager prefill step is host-bound. One 512-token prompt on Qwen3-0.6B took 25-34 ms
of wall time for 1.9 ms of GPU time on an H200 (``scripts/profile_prefill_step.py``): ~10
launches a layer, each through Python. Served traffic arrives staggered, so prompts are
prefilled a few at a time between decode steps, and those steps set the pace. Decode steps
replay whole graphs (``cuda_graphs``); a prefill step's attention depends on its sequence
lengths, so it stays eager, and everything between two attention calls (o_proj, the norms,
the MLP, the next layer's QKV projection, RoPE and KV write) replays as one graph per
token-count bucket: L+1 replays and L attention launches a step. vLLM cuts its piecewise
graphs at the same place.

A step of T tokens runs in the smallest bucket >= T. The padding rows compute values that
nothing reads: position 0, slot -1 (no KV write), the attention runs on the first T rows
only, and only the first T rows come back. Between pieces the state lives in static
buffers that every layer and bucket share (residual stream, q/k/v, attention output), so
the memory is one set of buffers at the largest bucket plus the graphs' pool.

Dense models only (an MoE layer routes with host-side counts). ``graphs=False`` runs the
same pieces without capturing them: what the CPU tests check against the model's forward.
"""

from __future__ import annotations

import torch

from pdflow.attention.metadata import AttentionMetadata
from pdflow.worker.stage_runner import StageRunner

__all__ = ["PiecewiseGraphRunner", "piecewise_buckets", "piecewise_supported"]


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts a step is padded up to: 16, 32, 64, then steps of about 1.5x (at most
    a third of a bucket is padding past 64), capped by the step budget ``max_tokens``."""
    sizes, b = [16, 32, 64], 64
    while b < max_tokens:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3
        sizes.append(b)
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def piecewise_supported(model: torch.nn.Module) -> bool:
    """No MoE layer (its routing reads counts on the host, which a graph cannot)."""
    cfg = model.config
    return not any(cfg.is_moe_layer(int(i)) for i in model.model.layers)


class PiecewiseGraphRunner:
    """``can_run(inputs)`` then ``run(inputs, positions, meta, taps_in) -> (hidden, taps)``,
    the same contract as ``StageRunner.forward``. Captures lazily on first use (every TP
    peer of the stage reaches its first such step together), largest bucket first."""

    def __init__(self, stage: StageRunner, *, max_tokens: int, hidden_size: int | None = None,
                 relayed_in: int = 0, dtype: torch.dtype, graphs: bool = True, buckets: list[int] | None = None):
        self.stage, self.model = stage, stage.model
        self.device = torch.device(stage.device)
        self.graphs_on = graphs
        self.buckets = sorted(buckets or piecewise_buckets(max_tokens))
        self.layers = list(self.model.model.layers.items())
        attn = self.layers[0][1].self_attn
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        n, dev, width = self.buckets[-1], self.device, self.model.config.hidden_size
        self.inputs = (torch.zeros(n, dtype=torch.int64, device=dev) if hidden_size is None
                       else torch.zeros(n, hidden_size, dtype=dtype, device=dev))
        self.taps_in = (torch.zeros(n, relayed_in * hidden_size, dtype=dtype, device=dev)
                        if relayed_in and hidden_size else None)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.residual = torch.zeros(n, width, dtype=dtype, device=dev)
        self.qkv = torch.zeros(n, (hq + 2 * hkv) * d, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(n, hq, d, dtype=dtype, device=dev)
        taps = [int(i) for i, _ in self.layers if int(i) in stage.capture_layers]
        self.tap_store = {i: torch.zeros(n, width, dtype=dtype, device=dev) for i in taps}
        self.fused = self.model.uses_fused_kernels(self.residual)
        # Per bucket: its pieces (graphs, or the calls themselves), the q/k/v views and
        # whether the K/V is stored by the projection, and the last piece's outputs.
        self.pieces: dict[int, list] = {}
        self.views: dict[int, tuple] = {}
        self.outputs: dict[int, tuple] = {}
        self.pool = None
        self.replays = 0

    def can_run(self, inputs: torch.Tensor) -> bool:
        return 0 < inputs.shape[0] <= self.buckets[-1]

    # -- the pieces --------------------------------------------------------------------

    def _first(self, tb: int):
        def piece():
            x = self.inputs[:tb]
            if self.model.model.is_first:
                x = self.model.model.embed_tokens(x)
            *qkv, residual = self.layers[0][1].before_attention(
                x, None, self.positions[:tb], self.slots[:tb], self.fused, into=self.qkv[:tb])
            self.residual[:tb].copy_(residual)
            return tuple(qkv)
        return piece

    def _between(self, tb: int, i: int):
        """After layer ``i - 1``'s attention up to layer ``i``'s (``i == L``: to the end)."""
        last = i == len(self.layers)

        def piece():
            index, layer = self.layers[i - 1]
            x, residual = layer.after_attention(self.attn_out[:tb], self.residual[:tb], self.fused)
            if int(index) in self.tap_store:
                self.tap_store[int(index)][:tb].copy_(x + residual)
            if last:
                return self._end(tb, x, residual)
            *qkv, residual = self.layers[i][1].before_attention(
                x, residual, self.positions[:tb], self.slots[:tb], self.fused, into=self.qkv[:tb])
            self.residual[:tb].copy_(residual)
            return tuple(qkv)
        return piece

    def _end(self, tb: int, x, residual):
        body = self.model.model
        hidden = body.norm(x, residual, fused=self.fused)[0] if body.is_last else x + residual
        parts = ([self.taps_in[:tb]] if self.taps_in is not None else []) + [t[:tb] for t in self.tap_store.values()]
        return hidden, (torch.cat(parts, dim=-1) if parts else None)

    # -- capture and run ---------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket's pieces, largest bucket first, into one memory pool; each piece
        after a call outside the capture (Triton compiles, NCCL connects there)."""
        self.slots.fill_(-1)
        stream = torch.cuda.Stream(self.device) if self.graphs_on else None
        for tb in sorted(self.buckets, reverse=True):
            calls = [self._first(tb)] + [self._between(tb, i) for i in range(1, len(self.layers) + 1)]
            if not self.graphs_on:
                self.pieces[tb] = calls
                continue
            graphs = []
            for j, call in enumerate(calls):
                torch.cuda.synchronize(self.device)
                call()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    out = call()
                self.pool = self.pool or graph.pool()
                if j == 0:
                    self.views[tb] = out
                elif j == len(calls) - 1:
                    self.outputs[tb] = out
                graphs.append(graph)
            self.pieces[tb] = graphs
        if self.graphs_on:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.pieces.clear()
        self.views.clear()
        self.outputs.clear()
        self.pool = None

    def _piece(self, tb: int, j: int):
        piece = self.pieces[tb][j]
        if not self.graphs_on:
            out = piece()
            if j == 0:
                self.views[tb] = out
            elif j == len(self.layers):
                self.outputs[tb] = out
            return
        piece.replay()

    @torch.inference_mode()
    def run(self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            taps_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the step into the bucket's buffers, run its pieces with the attention
        between them, return the first T rows (views: use them before the next step)."""
        if not self.pieces:
            self.capture()
        t = inputs.shape[0]
        tb = next(b for b in self.buckets if b >= t)
        self.inputs[:t].copy_(inputs)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slot_mapping)
        if t < tb:  # padding rows: position 0, no KV write
            self.positions[t:tb].zero_()
            self.slots[t:tb].fill_(-1)
        if self.taps_in is not None:
            self.taps_in[:t].copy_(taps_in)
        self._piece(tb, 0)
        # Every layer's q/k/v live in the same static buffers: one set of views a step,
        # and the attention writes straight into the next piece's input.
        q, k, v, stored = self.views[tb]
        q, k, v, out = q[:t], k[:t], v[:t], self.attn_out[:t]
        for i, (_, layer) in enumerate(self.layers):
            layer.self_attn.attn(q, k, v, meta, kv_stored=stored, out=out)
            self._piece(tb, i + 1)
        self.replays += 1
        hidden, taps = self.outputs[tb]
        return hidden[:t], (taps[:t] if taps is not None else None)
