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
    # Seconds the rank's start-up warm-up took (compiles, graph captures) before this.
    warm_up_s: float = 0.0


class SamplingSpec(msgspec.Struct, kw_only=True):
    """What the sampling rank needs per sequence (the sampling half of SamplingParams)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class KVExport(msgspec.Struct, kw_only=True):
    """Write one request's prompt blocks (producer ids) into the consumer's blocks, as the
    graph's cut plan says, once this step's forward has filled them. ``consumer``: the
    consumer instance (its id in the producer ranks' peer table)."""

    request_id: str
    consumer: str = ""
    nonce: int
    src_blocks: list[int]
    dst_blocks: list[int]


class PromptLogprobRows(msgspec.Struct, kw_only=True):
    """One request's prompt positions in this step whose logits score the next prompt
    token: flattened rows ``first_row ..`` each predicting ``targets[i]``; ``top``: how
    many most likely tokens to report per row as well."""

    request_id: str
    first_row: int
    targets: list[int]
    top: int = 0


class TopLogprobs(msgspec.Struct, kw_only=True, array_like=True):
    """The most likely tokens at one position, most likely first (logprobs under the
    model's unmodified distribution)."""

    token_ids: list[int]
    logprobs: list[float]


class PromptLogprobs(msgspec.Struct, kw_only=True):
    """What a step computed of one request's PromptLogprobRows, row for row."""

    request_id: str
    logprobs: list[float]
    top: list[TopLogprobs] = []


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
    # Producer only: KV to send once this step's forward has written it. Each rank hands
    # them to its KV sender and goes on; every rank answers KVSent when they have settled.
    exports: list[KVExport] = []
    # Speculative decoding (empty without a drafter). Per sampled sequence: drafts at the
    # tail of its rows (its rows are [anchor, drafts]; sample_rows names the last).
    num_drafts: list[int] = []
    # Per sequence: the token after its last row when known (a prefill chunk's next prompt
    # token), else -1; and the draft context entries its pool already holds at its first
    # forward since admission (prefix-cache hit, transferred prompt), else -1.
    next_token_ids: list[int] = []
    context_adopt: list[int] = []
    # Overlap scheduling (one rank): rows of token_ids whose token is the still-unread
    # sample of step ``placeholder_step`` (their token_ids entry is a 0 placeholder), and
    # for each, the index of that sample in the step's sampled rows. The rank gathers them
    # on the device before the forward.
    placeholder_rows: list[int] = []
    placeholder_samples: list[int] = []
    placeholder_step: int = -1
    # Logprobs a request asked for (empty when none did: the default step pays nothing).
    # Per sampled row, how many most likely tokens to report with its token(s) (-1: none);
    # and prompt positions to score (echo with logprobs), computed from this forward.
    top_logprobs: list[int] = []
    prompt_logprobs: list[PromptLogprobRows] = []


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
    # Speculative decoding: tokens each sampled sequence emitted (accepted drafts + 1;
    # token_ids/logprobs are flat over them), and its drafts for the next step.
    num_emitted: list[int] = []
    draft_ids: list[list[int]] = []
    # StepInput.top_logprobs: per emitted token (flat like token_ids), its top k (empty
    # for rows that did not ask); StepInput.prompt_logprobs answered in the same order.
    top_logprobs: list[TopLogprobs] = []
    prompt_logprobs: list[PromptLogprobs] = []


class KVSent(msgspec.Struct, tag=True, kw_only=True):
    """A producer rank's KV sender settled some requests' exports (sent off the forward, so
    it comes whenever they settle, between or before step answers): every consumer rank
    has their blocks, except those in ``failed`` (request id -> why)."""

    rank: int
    request_ids: list[str]
    failed: dict[str, str] = {}
    # Bytes this rank moved for the requests that landed (the cut runs it wrote).
    nbytes: int = 0


class UnitAddress(msgspec.Struct, kw_only=True):
    """One registered unit cache of a consumer rank, with the layout it was built with
    (checked against the producer's plan at pairing)."""

    name: str
    base: int
    block_bytes: int
    num_blocks: int
    # Blocks per registered chunk (a descriptor stays inside one); 0: one chunk.
    chunk_blocks: int
    family: str
    field: str
    layer: int
    heads: list[int]
    head_dim: int
    dtype: str
    page_tokens: int
    block_size: int


class KVEndpoint(msgspec.Struct, kw_only=True):
    """Where a rank's KV pool can be written: its transfer session and unit addresses."""

    rank: int
    session_id: str
    units: list[UnitAddress]
    # transfer=nccl: "cpu" or "cuda:<GPU UUID>", so a producer rank picks how bytes move.
    device: str = ""
    # Two-sided pairs: the token a producer rank's hello must present (``transfer.grants``).
    pairing: str = ""


class OpenKVLink(msgspec.Struct, tag=True, kw_only=True):
    """Owner -> rank: register the KV pool with the transfer engine; a consumer's ranks
    check hellos and each request's nonce with ``key`` (``transfer.grants``)."""

    key: bytes = b""


class KVLinkOpened(msgspec.Struct, tag=True, kw_only=True):
    endpoint: KVEndpoint


class PairConsumer(msgspec.Struct, tag=True, kw_only=True):
    """Owner -> producer rank: the ranks (every one) of consumer instance ``consumer`` to
    write to; added to the rank's peer table beside other consumers'."""

    endpoints: list[KVEndpoint]
    consumer: str = ""


class RefusalInfo(msgspec.Struct, kw_only=True):
    code: str
    message: str
    fix: str


class Paired(msgspec.Struct, tag=True, kw_only=True):
    rank: int
    # Empty when paired; else every reason the rank refused (nothing was written).
    refusals: list[RefusalInfo] = []


class ForgetConsumer(msgspec.Struct, tag=True, kw_only=True):
    """Owner -> producer rank: consumer instance ``consumer`` stopped (or a transfer to it
    failed): close its peers and drop them from the rank's peer table (exports in flight
    settle first). Also a stopping consumer's body of ``POST /pdflow/unpair``."""

    consumer: str


class Forgot(msgspec.Struct, tag=True, kw_only=True):
    rank: int
    # Whether the rank held peers of that consumer (False: nothing to close).
    held: bool


class Shutdown(msgspec.Struct, tag=True, kw_only=True):
    reason: str = ""


class RankError(msgspec.Struct, tag=True, kw_only=True):
    rank: int
    error: str


Message = (RankReady | StepInput | StepOutput | Shutdown | RankError | KVSent | OpenKVLink
           | KVLinkOpened | PairConsumer | Paired | ForgetConsumer | Forgot)
ControlMessage = OpenKVLink | PairConsumer | ForgetConsumer

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
