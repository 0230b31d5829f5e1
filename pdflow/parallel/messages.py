"""Typed messages between an instance's owner and its ranks (msgspec, never dicts).

The owner (scheduler, block manager) sends each rank the same ``StepInput``; ranks
exchange activations over torch.distributed; the last stage's first TP rank answers with
``StepOutput``. Tensors never ride these pipes: only token ids and block bookkeeping.
"""

from __future__ import annotations

import msgspec


class RankReady(msgspec.Struct, tag=True, kw_only=True):
    rank: int
    pid: int
    num_kv_blocks: int


class SamplingSpec(msgspec.Struct, kw_only=True):
    """What the sampling rank needs per sequence (the sampling half of SamplingParams)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class StepInput(msgspec.Struct, tag=True, kw_only=True):
    step: int
    # Request ids, in batch order.
    seq_ids: list[str]
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    # Flattened rows whose logits are sampled (a sequence's last known token).
    sample_rows: list[int]
    sample_seq_ids: list[str]
    sampling: list[SamplingSpec]
    # Sequences finished or aborted since the last step: ranks drop their state.
    released_seq_ids: list[str] = []
    # Return the last stage's relayed drafter taps for every row (StepOutput.taps).
    capture_taps: bool = False


class StepOutput(msgspec.Struct, tag=True, kw_only=True):
    step: int
    token_ids: list[int]
    logprobs: list[float]
    # The last stage's relayed taps for every row of the step, [rows, taps * hidden] as
    # float32 bytes, only when StepInput.capture_taps (tests; the drafter reads them in place).
    taps: bytes = b""
    taps_shape: list[int] = []
    # The stage that answered replayed a captured CUDA graph for this step.
    cuda_graph: bool = False


class Shutdown(msgspec.Struct, tag=True, kw_only=True):
    reason: str = ""


class RankError(msgspec.Struct, tag=True, kw_only=True):
    rank: int
    error: str


Message = RankReady | StepInput | StepOutput | Shutdown | RankError

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
