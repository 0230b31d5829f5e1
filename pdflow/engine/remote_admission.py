"""How a P/D consumer admits a prompt (decode-side prefix reuse and local prefill), and
settles it once the producer's KV has landed or failed.

Why here: ``Deployment`` and a separately started decode instance (``serve/pd_decode``)
admit and settle the same way, so the choice, the counts and the outcome live in one place. The consumer
matches the prompt against its own prefix cache (whole blocks) and allocates only the
uncached suffix; the ``KVTarget`` names just those blocks (``first_block`` on), so the
producer, which still computes the whole prompt (from its own prefix cache where it
can), writes only them. A prompt whose uncached part is short, one a producer would
mostly recompute (its blocks were computed here: local turns, generated answers), or one
no producer can take now, is prefilled by the consumer itself: no transfer at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.sequence import KVTarget
from pdflow.spec.router import RouterSpec


@dataclass(kw_only=True, slots=True)
class ReuseCounts:
    """One consumer's admissions (Prometheus counters, bench ratios)."""

    remote_prefills: int = 0
    local_prefills: int = 0
    # Of the local ones: prefilled here because a producer would recompute much more
    # (``router.local_prefill_factor``), though the uncached part was not short.
    local_for_producer_misses: int = 0
    # Prompt tokens a remote prefill did not move: they were in this instance's cache.
    reused_tokens: int = 0
    # Prompt blocks producers were asked to write into this instance.
    requested_blocks: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    """``local``: the consumer prefills it; else ``target`` is where the producer writes
    (None with ``local`` False: the pool is short now, admit it later)."""

    local: bool = False
    target: KVTarget | None = None


def admit_to_consumer(consumer: LLMEngine, prompt: list[int], sampling: SamplingParams, request_id: str, *,
                      counts: ReuseCounts, consumer_id: str = "") -> Admission:
    """Admit ``prompt`` on ``consumer``: locally (its uncached part is below
    ``router.local_prefill_tokens``, or a producer would compute ``local_prefill_factor``
    times as much: ``_producer_misses``), or parked for a producer's KV into the blocks
    after its cached prefix (``router.prefix_reuse``) or into all of them."""
    router = consumer.spec.router
    here, there = _uncached(consumer, prompt)
    if here < router.local_prefill_tokens or _producer_misses(router, here, there):
        consumer.add_request(prompt, sampling, request_id)
        counts.local_prefills += 1
        counts.local_for_producer_misses += int(here >= router.local_prefill_tokens)
        return Admission(local=True)
    blocks = consumer.add_remote_request(prompt, sampling, request_id, reuse_prefix=router.prefix_reuse)
    if blocks is None:
        return Admission()
    first = consumer.awaiting_kv[request_id].num_cached_tokens // consumer.blocks.block_size
    suffix = tuple(blocks[first:])
    counts.remote_prefills += 1
    counts.reused_tokens += first * consumer.blocks.block_size
    counts.requested_blocks += len(suffix)
    return Admission(target=KVTarget(blocks=suffix, nonce=consumer.instance.kv_nonce(list(suffix)),
                                     consumer=consumer_id, first_block=first))


def _uncached(consumer: LLMEngine, prompt: list[int]) -> tuple[int, int]:
    """The prompt tokens this consumer would compute, and those a producer would (a guess:
    all but the leading blocks a producer computed for this consumer before)."""
    if not consumer.spec.router.prefix_reuse:
        return len(prompt), len(prompt)
    cached, producer_held = consumer.blocks.peek_prefix_sources(prompt)
    return len(prompt) - cached, len(prompt) - producer_held


def _producer_misses(router: RouterSpec, here: int, there: int) -> bool:
    """Local prefill is on and a producer would compute ``router.local_prefill_factor``
    times what this instance would, or more."""
    return bool(router.local_prefill_tokens and router.local_prefill_factor
                and there >= router.local_prefill_factor * here)


def settle_remote(consumer: LLMEngine, request_id: str, first: TokenOutput | None, error: str | None, *,
                  aborted: bool = False) -> TokenOutput:
    """The consumer's end of a remote prefill whose transfer settled: a request aborted
    meanwhile frees its blocks only now (no late write lands in reused blocks), a failed
    one (``error``) frees them and ends with it, and one whose KV landed decodes on from
    the producer's first token (its report handed on)."""
    if aborted or error is not None or first is None:
        reason = "abort" if aborted else "error"
        consumer.fail_remote(request_id, reason)
        return TokenOutput(request_id=request_id, index=-1, token_id=-1, logprob=0.0, finished=True,
                           finish_reason=reason, error=None if aborted else error or "no first token")
    return consumer.complete_remote_prefill(request_id, first.token_id, first.logprob, first)
