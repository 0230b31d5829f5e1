"""``pdflow.Deployment(spec)``: both instances of a run graph, driven from this process
(tests, ``pdflow run``): the producer prefills each prompt and writes its KV into blocks
the consumer allocated for it, which decodes on. ``generate``/``stream`` behave like
``LLM``'s; ``mode: monolithic`` runs the decode instance alone.

Faults: a failed transfer ends its request with an error and frees its blocks on both
sides. When one instance dies, its requests in flight end with an error, and the other
serves every later request alone (it holds the whole model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdflow.engine.engine_facts import EngineFacts
from pdflow.engine.instance import Instance
from pdflow.engine.llm import Prompt, requests_of
from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.outputs import RequestOutput, TokenOutput
from pdflow.engine.remote_admission import ReuseCounts, admit_to_consumer, settle_remote
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.sequence import Sequence as EngineSequence
from pdflow.graph import CONSUMER, PRODUCER, build_graph
from pdflow.graph.host import read_devices
from pdflow.spec import RunSpec


@dataclass(kw_only=True, slots=True)
class _Request:
    """A request's sampling, and its output built as its tokens come."""

    sampling: SamplingParams
    out: RequestOutput
    # Aborted while its KV may still be on the way: ended once the transfer is settled.
    aborted: bool = False

    @property
    def request_id(self) -> str:
        return self.out.request_id


class InstanceLost(RuntimeError):
    """A request offered to a deployment none of whose instances is up."""


class Deployment(EngineFacts):
    def __init__(self, spec: RunSpec):
        if not isinstance(spec, RunSpec):
            raise TypeError(f"Deployment needs a RunSpec (pdflow.compose(overrides)), got {type(spec).__name__}")
        devices = read_devices(spec)  # once, before either instance allocates
        build_graph(spec, devices).raise_if_refused()
        self.spec = spec
        self.producer: LLMEngine | None = None
        self.consumer: LLMEngine | None = None
        try:
            self.consumer = LLMEngine(Instance(spec, CONSUMER, devices))
            if spec.mode != "monolithic":
                self.producer = LLMEngine(Instance(spec, PRODUCER, devices))
                self.producer.instance.pair(self.consumer.instance.open_kv_link())
        except BaseException:
            self.shutdown()
            raise
        self._ids = itertools.count()
        self._queue: deque[_Request] = deque()
        self._requests: dict[str, _Request] = {}
        # Requests whose RequestOutput ``generate`` will build; others are dropped at the end.
        self._keep: set[str] = set()
        # Why an instance was lost (it serves nothing more); None while it is up.
        self.lost: dict[str, str | None] = {PRODUCER: None, CONSUMER: None}
        # The consumer's admissions: remote or local prefills, prompt tokens reused.
        self.reuse = ReuseCounts()
        # Aborted while the producer had them: its copy, ended once nothing of it may
        # still write into the consumer's blocks (``_settle_dropped``).
        self._dropping: dict[str, EngineSequence] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def shutdown(self) -> None:
        for engine in (self.producer, self.consumer):
            if engine is not None:
                engine.shutdown()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests -----------------------------------------------------------------------

    def submit(self, prompts: Prompt | Sequence[Prompt],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[str]:
        if not self._live():
            raise InstanceLost(f"{self._all_lost()}; restart it")
        ids = []
        for prompt, p in requests_of(prompts, sampling, self.tokenizer, self.vocab_size):
            out = RequestOutput(request_id=f"d{next(self._ids)}", prompt_token_ids=prompt, token_ids=[], logprobs=[],
                                text="", finish_reason=None, top_logprobs=[] if p.logprobs is not None else None)
            req = _Request(sampling=p, out=out)
            self._queue.append(req)
            self._requests[req.request_id] = req
            ids.append(req.request_id)
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Outputs in prompt order."""
        ids = self.submit(prompts, sampling)
        self._keep.update(ids)
        for _ in self.run():
            pass
        self._keep.difference_update(ids)
        return [self._requests.pop(rid).out for rid in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling: SamplingParams | Sequence[SamplingParams]) -> Iterator[TokenOutput]:
        self.submit(prompts, sampling)
        yield from self.run()

    def run(self) -> Iterator[TokenOutput]:
        """Step both instances until every submitted request has finished."""
        while self._busy():
            yield from self._turn()

    def step(self) -> list[TokenOutput]:
        """One turn of both instances: every token it produced (none when idle). What a
        server's loop calls, so one turn's tokens leave together."""
        return list(self._turn()) if self._busy() else []

    def _turn(self) -> Iterator[TokenOutput]:
        """Admit, then submit the producer's step and the consumer's before collecting
        either, so a decode step computes while a prefill step does, not after it."""
        yield from self._admit()
        yield from self._settle_dropped()
        stepping = [role for role, e in self._live().items() if e.has_unfinished()]
        for role in stepping:
            yield from self._guarded(role, functools.partial(self._submit, role))
        for role in stepping:
            if self._up(role):  # not lost while submitting, nor by the producer's probe
                yield from self._guarded(role, self._collect_producer if role == PRODUCER
                                         else self._collect_consumer)

    def abort(self, request_id: str) -> bool:
        """End a request now. One the producer has is dropped there (a prompt not computed
        yet never is); if a step or its export may still write into the consumer's blocks,
        it ends once they settled, so those blocks are never reused under a late write."""
        req = self._requests.get(request_id)
        if req is None or req.out.finish_reason is not None:
            return False
        if req in self._queue:
            self._queue.remove(req)
        elif request_id in self.consumer.awaiting_kv and self._up(PRODUCER):
            req.aborted = True
            held = self.producer.drop(request_id)  # a prompt not computed yet never is
            if held is not None:
                self._dropping[request_id] = held  # a step or its export may still write
                return True
            self.consumer.fail_remote(request_id, "abort")
        elif not any(e.abort(request_id) for e in self._live().values()):
            return False
        req.out.finish_reason = "abort"
        self._settle(req)
        return True

    # -- internals ----------------------------------------------------------------------

    def _up(self, role: str) -> bool:
        return self._engine_of(role) is not None and self.lost[role] is None

    def _live(self) -> dict[str, LLMEngine]:
        """The instances up, by role."""
        return {role: self._engine_of(role) for role in (PRODUCER, CONSUMER) if self._up(role)}

    def _busy(self) -> bool:
        return bool(self._queue) or any(e.has_unfinished() or e.awaiting_kv for e in self._live().values())

    def _admit(self) -> Iterator[TokenOutput]:
        """Hand queued requests out: P/D while both instances are up, else to whichever
        instance survives, whole."""
        while self._queue:
            req = self._queue[0]
            if self._up(PRODUCER) and self._up(CONSUMER):
                admitted = admit_to_consumer(self.consumer, req.out.prompt_token_ids, req.sampling, req.request_id,
                                             counts=self.reuse)
                if not admitted.local and admitted.target is None:
                    return  # the consumer's pool is full: admit after some requests finish
                if admitted.target is not None:
                    first = dataclasses.replace(req.sampling, max_tokens=1)
                    self.producer.add_request(req.out.prompt_token_ids, first, req.request_id, kv_target=admitted.target)
            else:
                alone = self.consumer if self._up(CONSUMER) else self.producer if self._up(PRODUCER) else None
                if alone is None:
                    yield self._fail(req.request_id, self._all_lost())
                    self._queue.popleft()
                    continue
                alone.add_request(req.out.prompt_token_ids, req.sampling, req.request_id)
            self._queue.popleft()

    def _all_lost(self) -> str:
        return "every instance of this deployment was lost (" + "; ".join(
            f"{role}: {why}" for role, why in self.lost.items() if why) + ")"

    def _engine_of(self, role: str) -> LLMEngine | None:
        return self.producer if role == PRODUCER else self.consumer

    def _submit(self, role: str) -> list[TokenOutput]:
        self._engine_of(role).submit()
        return []

    def _collect_producer(self) -> Iterator[TokenOutput]:
        """The producer's oldest step, and the prompts whose KV settled since: each one
        that landed goes on decoding on the consumer (its first token is the producer's).
        It waits for a transfer only while the consumer has no step of its own to collect."""
        consumer_busy = self._up(CONSUMER) and self.consumer.has_unfinished()
        for out in self.producer.collect(wait=not consumer_busy):
            if out.kv_settled and not self._up(CONSUMER):
                continue  # its consumer is lost: the request has already ended in an error
            if not out.kv_settled:
                yield self._record(out)  # served whole by the producer (the consumer is lost)
                continue
            req = self._requests.get(out.request_id)
            aborted = req is not None and req.aborted
            failed = None if out.kv_error is None else f"KV transfer failed: {out.kv_error}"
            settled = settle_remote(self.consumer, out.request_id, out, failed, aborted=aborted)
            if aborted:
                req.out.finish_reason = "abort"
                self._settle(req)
                yield settled
            elif failed is not None:
                yield self._fail(out.request_id, failed)
                # A dead consumer rank shows first as failed writes: find out now, so later
                # requests go to the producer alone instead of failing the same way.
                yield from self._guarded(CONSUMER, self._probe_consumer)
            else:
                yield self._record(settled)

    def _settle_dropped(self) -> Iterator[TokenOutput]:
        """Aborted requests the producer dropped mid-step or mid-export: the consumer frees
        their blocks once nothing of the producer's may still write into them."""
        for rid, held in list(self._dropping.items()):
            if held.holds_blocks and self._up(PRODUCER):
                continue
            del self._dropping[rid]
            if rid not in self.consumer.awaiting_kv:
                continue  # ended already: its producer was lost
            yield settle_remote(self.consumer, rid, None, None, aborted=True)
            if (req := self._requests.get(rid)) is not None:
                req.out.finish_reason = "abort"
                self._settle(req)

    def _collect_consumer(self) -> list[TokenOutput]:
        return [self._record(out) for out in self.consumer.collect()]

    def _probe_consumer(self) -> list[TokenOutput]:
        self.consumer.executor.check()
        return []

    def _guarded(self, role: str, step) -> Iterator[TokenOutput]:
        """Run one instance's submit or collect; if the instance dies, end its requests
        with an error."""
        try:
            outputs = list(step())  # ran to the end, recorded, before any is yielded
        except Exception as err:  # a lost rank (RankFailed), a lost device, ...
            self.lost[role] = f"{type(err).__name__}: {err}"
            yield from self._lose(role)
            return
        yield from outputs

    def _lose(self, role: str) -> Iterator[TokenOutput]:
        engine = self._engine_of(role)
        why = f"the {role} instance was lost ({self.lost[role]})"
        owned = {s.request_id for s in (*engine.scheduler.running, *engine.scheduler.waiting)}
        owned |= set(engine.scheduler.transfers)  # waiting for KV, or sending it
        if role == PRODUCER:
            owned |= set(self.consumer.awaiting_kv)
            for rid in list(self.consumer.awaiting_kv):
                self.consumer.fail_remote(rid)
        for rid in sorted(owned):
            if rid in self._requests and self._requests[rid].out.finish_reason is None:
                yield self._fail(rid, why)
        with contextlib.suppress(Exception):  # already torn down by the launcher
            engine.shutdown()

    def _record(self, out: TokenOutput) -> TokenOutput:
        req = self._requests.get(out.request_id)
        if req is not None:
            got = req.out
            got.token_ids.append(out.token_id)
            got.logprobs.append(out.logprob)
            got.text += out.text
            got.num_drafted, got.num_accepted = out.num_drafted, out.num_accepted
            got.num_verify_steps = out.num_verify_steps
            if out.index == 0:  # what the first token reports
                got.num_cached_prompt_tokens = out.num_cached_tokens
                got.prompt_logprobs, got.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
            if out.top_logprobs is not None and got.top_logprobs is not None:
                got.top_logprobs.append(out.top_logprobs)
            if out.finished:
                got.finish_reason = out.finish_reason
                self._settle(req)
        return out

    def _settle(self, req: _Request) -> None:
        if req.request_id not in self._keep:
            self._requests.pop(req.request_id, None)

    def _fail(self, request_id: str, why: str) -> TokenOutput:
        req = self._requests.get(request_id)
        if req is not None:
            req.out.finish_reason, req.out.error = "error", why
            self._settle(req)
        return TokenOutput(request_id=request_id, index=-1, token_id=-1, logprob=0.0, finished=True,
                           finish_reason="error", error=why)

    # -- reporting ----------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        """The instance requests meet (what ``EngineFacts`` reports): the consumer, the
        producer when serving alone; with none up, the consumer still, whose facts (vocab,
        lengths) a refusal reads while ``submit`` raises ``InstanceLost``."""
        if self._up(CONSUMER) or not self._up(PRODUCER):
            return self.consumer
        return self.producer

    @property
    def max_model_len(self) -> int:
        return min(e.max_model_len for e in (self.producer, self.consumer) if e is not None)

    @property
    def startup_s(self) -> float:
        """Both instances' start-ups (built one after the other)."""
        return sum(e.instance.startup_s for e in (self.producer, self.consumer) if e is not None)

    @property
    def compile_s(self) -> float:
        return sum(e.instance.compile_s for e in (self.producer, self.consumer) if e is not None)

    @property
    def kv_bytes_sent(self) -> int:
        """Prompt KV bytes the producer handed to its sender so far (prefix reuse on the
        consumer lowers it: only uncached suffixes move)."""
        p = self.producer
        return p.exported_blocks * p.graph.transfer_bytes_per_block if p is not None else 0

    def free_kv_blocks(self) -> dict[str, int]:
        """Free blocks of each live instance (equal to its pool when idle: no leak)."""
        return {role: e.num_free_kv_blocks for role, e in self._live().items()}
