"""CUDA graphs for steady drafted decode steps: the target's verify over [anchor, k
drafts] per sequence (as decode rows), the drafter's context K/V write, greedy
verification and the next block proposal, captured as one graph per batch bucket.

Eagerly, a drafted step of a small model is hundreds of launches and several host
reads (the verify's logits, the emitted tokens, the proposal); replayed, it is one
host->device copy of the step's ids, positions, slots and block tables, one graph, and
one device->host read of the emitted tokens, accepted counts, logprobs and next drafts.
Only the steady state is captured: every sequence of the step verifies k drafts (k+1
rows), greedy, with no prefill chunk, adoption, export or tap capture in it, and a
``graphable`` drafter (dspark). Anything else runs through ``Drafting.step``, which
computes the same thing. Padding sequences of a bucket write nothing (slot -1) and
attend their own k+1 rows over block 0.
"""

from __future__ import annotations

import torch

from pdflow.attention.metadata import AttentionMetadata
from pdflow.parallel.messages import StepInput
from pdflow.spec_decode import verify
from pdflow.worker.cuda_graphs import BucketGraphs, graph_buckets
from pdflow.worker.drafting import DraftedStep, Drafting
from pdflow.worker.stage_runner import ROWS_AS_DECODE, StageRunner

__all__ = ["DraftedGraphRunner", "drafted_step"]


def drafted_step(runner: StageRunner, drafting: Drafting, packed: torch.Tensor, cu: torch.Tensor,
                 batch: int, width: int) -> torch.Tensor:
    """A whole steady drafted step on device tensors (no host read): the ops of
    ``Drafting.step`` for such a step, in its order. ``packed`` int64 holds the step's
    ids, positions and slots ([batch * (k+1)] each) then its block tables [batch, width];
    ``cu`` is arange(batch * (k+1) + 1) int32. Returns [batch, 3k+3] float64 (exact for
    token ids and float32 logprobs): emitted tokens (k+1, -1 past the emitted run), the
    accepted count, the next k drafts, the emitted tokens' logprobs (k+1)."""
    drafter, k = drafting.drafter, drafting.num_drafts
    k1 = k + 1
    rows = batch * k1
    ids, positions, slots = packed[: 3 * rows].view(3, rows)
    tables = packed[3 * rows: 3 * rows + batch * width].view(batch, width).to(torch.int32)
    meta = AttentionMetadata(  # one decode row per token over its causal prefix (stage_runner)
        decode_only=True, slot_mapping=slots, cu_seqlens_q=cu,
        context_lens=(positions + 1).to(torch.int32), block_tables=tables[:, None].expand(-1, k1, -1).reshape(rows, -1),
        max_seqlen_q=1, sequence_block_tables=tables,
    )
    hidden, taps = runner.forward(ids, positions, meta)
    features = taps if drafter.tap_layers else hidden
    drafter.check_features(features)
    drafter.write_context_device(features, positions, slots)
    logits = runner.model.compute_logits(hidden).view(batch, k1, -1)
    result = verify(logits, ids.view(batch, k1)[:, 1:])
    accepted = result.num_accepted
    last = result.tokens.gather(1, accepted[:, None])[:, 0]
    anchors = positions.view(batch, k1)[:, 0] + accepted + 1
    proposal = drafter.propose_device(last, anchors, tables, k)
    return torch.cat([result.tokens.double(), accepted[:, None].double(), proposal.tokens.double(),
                      result.logprobs.double()], dim=1)


class DraftedGraphRunner:
    """``applies(msg)`` (host checks) then ``run(msg) -> DraftedStep``.

    ``capture=False`` runs the same bucketed buffers and ``drafted_step`` eagerly (CPU
    tests of the padding and bookkeeping); on CUDA every bucket is captured at warm-up,
    largest first so smaller graphs share its memory pool."""

    def __init__(self, runner: StageRunner, drafting: Drafting, *, max_batch: int, block_table_width: int,
                 buckets: list[int] | None = None, capture: bool | None = None):
        self.runner, self.drafting = runner, drafting
        self.device = torch.device(runner.device)
        self.capturing = self.device.type == "cuda" if capture is None else capture
        self.k = drafting.num_drafts
        self.max_batch, self.width = max_batch, block_table_width
        self.buckets = sorted(buckets or graph_buckets(max_batch))
        n, k1, dev = self.buckets[-1], self.k + 1, self.device
        pin = dev.type == "cuda"
        size = n * (3 * k1 + self.width)
        self.packed = torch.zeros(size, dtype=torch.int64, device=dev)
        self.host_in = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host_out = torch.zeros((n, 3 * k1), dtype=torch.float64, pin_memory=pin)
        self.cu = torch.arange(n * k1 + 1, dtype=torch.int32, device=dev)
        self.pad_positions = list(range(k1)) * n
        self.captured = BucketGraphs()
        self.replays = 0  # steps run through the buckets (replayed, or eagerly when not capturing)

    def _step(self, bucket: int) -> torch.Tensor:
        rows = bucket * (self.k + 1)
        return drafted_step(self.runner, self.drafting, self.packed[: rows * 3 + bucket * self.width],
                            self.cu[: rows + 1], bucket, self.width)

    def applies(self, msg: StepInput) -> bool:
        """Host checks only: the step is the steady drafted state the buckets hold."""
        bs, k, k1 = len(msg.seq_ids), self.k, self.k + 1
        if not (0 < bs <= self.max_batch and k1 <= ROWS_AS_DECODE and msg.num_drafts == [k] * bs
                and msg.sample_seq_ids == msg.seq_ids and msg.cu_seqlens_q == list(range(0, bs * k1 + 1, k1))):
            return False
        if msg.exports or msg.capture_taps or msg.top_logprobs or any(a >= 0 for a in msg.context_adopt):
            return False
        if not all(p.greedy for p in msg.sampling) or len(msg.block_tables[0]) > self.width:
            return False
        # Each sequence's rows sit at consecutive positions ending at its context length.
        pos = msg.positions
        return all(pos[i * k1] + k == pos[i * k1 + k] == ctx - 1 for i, ctx in enumerate(msg.context_lens))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket; the inputs are all padding, so nothing is written."""
        if not self.capturing:
            return

        def prepare(bs: int):
            size = self._fill(bs, [], [], [], [])  # all padding, in this bucket's layout
            self.packed[:size].copy_(self.host_in[:size])
            return lambda: self._step(bs)

        self.captured.capture(self.buckets, self.device, prepare)

    def release(self) -> None:
        self.captured.release()

    def _fill(self, bucket: int, ids: list[int], positions: list[int], slots: list[int],
              tables: list[list[int]]) -> int:
        """A step's sequences into the host buffer in the bucket's layout, the rest of the
        bucket padding (ids 0, positions 0..k, slot -1: reads block 0, writes nothing);
        how many values the layout holds. Three host copies, whatever the batch."""
        k1, width = self.k + 1, self.width
        rows, pad = bucket * k1, bucket * k1 - len(ids)
        view = self.host_in[: 3 * rows + bucket * width]
        view[: 3 * rows] = torch.tensor(ids + [0] * pad + positions + self.pad_positions[:pad] + slots + [-1] * pad)
        grid = view[3 * rows:].view(bucket, width)
        grid.zero_()
        if tables:
            grid[: len(tables), : len(tables[0])] = torch.tensor(tables)
        return view.numel()

    @torch.inference_mode()
    def forward(self, msg: StepInput) -> torch.Tensor:
        """The step's device part: copy it into its bucket and replay (or run eagerly);
        ``drafted_step``'s output rows of the bucket (a view: read before the next step)."""
        if self.capturing and not self.captured.graphs:
            self.capture()
        bucket = next(b for b in self.buckets if b >= len(msg.seq_ids))
        size = self._fill(bucket, msg.token_ids, msg.positions, msg.slot_mapping, msg.block_tables)
        self.packed[:size].copy_(self.host_in[:size], non_blocking=True)
        self.replays += 1
        if self.capturing:
            return self.captured.replay(bucket)
        return self._step(bucket)

    @torch.inference_mode()
    def run(self, msg: StepInput) -> DraftedStep:
        """The ledger's record, the device part, one read back, and the drafter's host
        bookkeeping for the step."""
        k = self.k
        bs = len(msg.seq_ids)
        starts = msg.positions[:: k + 1][:bs]
        self.drafting.begin_graphed(msg, starts)  # the ledger refuses a gap before any write
        out = self.forward(msg)
        host = self.host_out[:bs]
        host.copy_(out[:bs], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the step's one host read
        emitted, logprobs, drafts = [], [], []
        for row in host.tolist():
            n = int(row[k + 1]) + 1
            emitted.append([int(t) for t in row[:n]])
            drafts.append([int(t) for t in row[k + 2: 2 * k + 2]])
            logprobs.append(row[2 * k + 2: 2 * k + 2 + n])
        return self.drafting.finish_graphed(msg, starts, emitted, logprobs, drafts)
