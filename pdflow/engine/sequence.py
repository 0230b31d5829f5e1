"""One request's tokens, progress and blocks as the scheduler and block manager see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdflow.engine.sampling_params import SamplingParams
from pdflow.spec_decode.stats import AcceptanceStats


@dataclass(frozen=True, kw_only=True, slots=True)
class KVTarget:
    """P/D, producer side: where this prompt's KV goes once prefilled (the consumer's
    block ids for the prompt's blocks ``first_block``.., in order), the nonce that names
    this transfer, and which consumer instance it is (the id it paired under; "" for
    ``Deployment``'s one). ``first_block``: the prompt blocks before it are in the
    consumer's prefix cache already, so only the suffix moves."""

    blocks: tuple[int, ...]
    nonce: int
    consumer: str = ""
    first_block: int = 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    # P/D consumer: blocks allocated, the producer writes the prompt's KV into them.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    # P/D producer: prompt prefilled and sampled, blocks held until the KV has been sent.
    SENDING_KV = "sending_kv"


@dataclass(kw_only=True, slots=True, eq=False)
class Sequence:
    request_id: str
    # Prompt followed by every generated token.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V sit in this sequence's blocks.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hash of each full block computed so far (prefix caching).
    block_hashes: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # Where a matched stop string begins in the decoded output text.
    stop_text_at: int | None = None
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = 0
    # In a step that has been submitted and not yet collected (pipeline parallelism):
    # neither scheduled again nor preempted until its result is back.
    in_flight: bool = False
    # The last step submitted with this sequence in it, and (when that or an earlier step
    # samples it) the step and the index among its sampled rows that hold its next token:
    # under overlap scheduling, a decode scheduled before that step is back reads it there.
    last_step: int = -1
    sampled_at: int = -1
    sample_index: int = -1
    # P/D producer: send the prompt's KV here after the step that completes the prompt;
    # the token that step sampled (emitted once the KV has settled), and, once it has,
    # None (landed) or why not (``kv_settled`` says whether it has).
    kv_target: KVTarget | None = None
    first_sample: tuple[int, float, list | None] | None = None
    kv_settled: bool = False
    kv_error: str | None = None
    # Speculative decoding: the drafts proposed after the last token (scored with it by
    # the next step), whether the next forward is the first since admission (the drafter
    # then adopts the context its pool holds), and this request's acceptance counts.
    draft_ids: list[int] = field(default_factory=list)
    fresh: bool = False
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    # SamplingParams.prompt_logprobs: prompt tokens 1.. scored so far, with their top k
    # ((token id, logprob) pairs), gathered chunk by chunk as the prompt is prefilled.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # SamplingParams.logprobs: each output token's top k.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def holds_blocks(self) -> bool:
        """A step in flight or an export not yet settled may still use its blocks (a P/D
        producer's aborted request: its consumer holds the target blocks until this is
        False, so no late write lands in reused ones)."""
        return self.in_flight or not self.finished
