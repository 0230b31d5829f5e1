"""The messages between API front processes and the engine-core process (msgpack, typed).

Fronts send ``Hello`` once, then ``Submit``/``Abort`` per request, ``Outcome`` per answered
request (the core keeps the metrics, so /metrics is the same whichever front serves it)
and ``Query`` (facts at start, metrics, health). The core answers a ``Query`` with a
``Reply`` and sends, after every engine turn, one ``Steps`` per front carrying a ``Delta``
for each of that front's requests that moved: token ids batched per step, never a message
per token. Text is the front's business (it detokenizes incrementally), so a ``Delta``
carries ids only. Decoding is strict: an unknown message or field type is an error.
"""

from __future__ import annotations

import msgspec

from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.backend import DraftStats
from pdflow.serve.serving_core import StreamEvent


class Hello(msgspec.Struct, tag=True, kw_only=True):
    """A front (re)started: the core ends what an earlier front of that index left running."""

    front: int


class Submit(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class Abort(msgspec.Struct, tag=True, kw_only=True):
    rid: str


class Outcome(msgspec.Struct, tag=True, kw_only=True):
    """How a front answered one request (stop, length, abort, error, rejected)."""

    outcome: str


class Query(msgspec.Struct, tag=True, kw_only=True):
    """``what``: "facts" (the model's limits, once the engine is up), "metrics" (Prometheus text)."""

    qid: int
    what: str


class Facts(msgspec.Struct, kw_only=True):
    """What a front validates and tokenizes with; ``tokenizer_folder`` None: ids only."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    tokenizer_folder: str | None


class Reply(msgspec.Struct, tag=True, kw_only=True):
    qid: int
    facts: Facts | None = None
    text: bytes = b""


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A ``StreamEvent`` of request ``rid`` minus its text. Every other field here has
    the name of a ``StreamEvent`` field and is copied both ways (``to_delta``,
    ``to_event``; ``tests/test_serve_split.py`` checks that they carry every field)."""

    rid: str
    token_ids: list[int] = []
    finish_reason: str | None = None
    draft: DraftStats | None = None
    error: str | None = None
    error_status: int = 500
    error_param: str | None = None
    retry_after_s: int | None = None
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0


class Steps(msgspec.Struct, tag=True, kw_only=True):
    """Every delta of one front's requests from one engine turn."""

    deltas: list[Delta]


ToCore = Hello | Submit | Abort | Outcome | Query
ToFront = Steps | Reply

encode = msgspec.msgpack.Encoder().encode
core_decoder = msgspec.msgpack.Decoder(ToCore)
front_decoder = msgspec.msgpack.Decoder(ToFront)


def to_delta(rid: str, event: StreamEvent) -> Delta:
    """Field by field, spelled out: this runs once per token per request in the core."""
    return Delta(rid=rid, token_ids=event.token_ids, finish_reason=event.finish_reason, draft=event.draft,
                 error=event.error, error_status=event.error_status, error_param=event.error_param,
                 retry_after_s=event.retry_after_s,
                 logprobs=event.logprobs, top_logprobs=event.top_logprobs, prompt_logprobs=event.prompt_logprobs,
                 prompt_top_logprobs=event.prompt_top_logprobs, num_cached_tokens=event.num_cached_tokens)


def to_event(delta: Delta, text: str) -> StreamEvent:
    """The inverse of ``to_delta`` (once per token per request in a front)."""
    return StreamEvent(text=text, token_ids=delta.token_ids, finish_reason=delta.finish_reason, draft=delta.draft,
                       error=delta.error, error_status=delta.error_status, error_param=delta.error_param,
                       retry_after_s=delta.retry_after_s,
                       logprobs=delta.logprobs, top_logprobs=delta.top_logprobs,
                       prompt_logprobs=delta.prompt_logprobs, prompt_top_logprobs=delta.prompt_top_logprobs,
                       num_cached_tokens=delta.num_cached_tokens)
