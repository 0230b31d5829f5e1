"""The owner side of one instance: requests, scheduling, blocks, and the step loop."""

from __future__ import annotations

import itertools
from collections import deque

from pdflow.engine.block_manager import BlockManager
from pdflow.engine.detokenizer import Detokenizer
from pdflow.engine.executor import Executor
from pdflow.engine.instance import Instance
from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.scheduler import ScheduledBatch, Scheduler
from pdflow.engine.sequence import KVTarget, Sequence, SequenceStatus
from pdflow.engine.step_input import build_step_input
from pdflow.model.config import DecoderConfig
from pdflow.parallel.messages import KVEndpoint, PromptLogprobs
from pdflow.spec_decode.stats import AcceptanceStats
from pdflow.worker.stage import draft_lookahead


class LLMEngine:
    """The owner of one instance: scheduler, block manager and detokenizer, stepping the
    instance's executor. Placement, KV units and the block count come from the run graph
    (through the instance)."""

    def __init__(self, instance: Instance):
        self.instance = instance
        self.spec, self.role = instance.spec, instance.role
        self.parallel = parallel = instance.parallel
        self.graph = instance.graph
        self.config: DecoderConfig = instance.config
        self.tokenizer = instance.tokenizer
        self.eos_token_ids = instance.eos_token_ids
        self.max_model_len = instance.max_model_len
        self.blocks = BlockManager(
            num_blocks=instance.num_kv_blocks, block_size=parallel.block_size,
            enable_prefix_caching=parallel.enable_prefix_caching,
        )
        # Speculative decoding when the graph plans a drafter (its last stage runs it).
        self.speculative = self.graph.drafter is not None
        self.scheduler = Scheduler(
            self.blocks, max_num_batched_tokens=parallel.max_num_batched_tokens,
            max_num_seqs=parallel.max_num_seqs, lookahead=draft_lookahead(self.graph, self.role),
            max_model_len=self.max_model_len, overlap=self.executor.overlap,
        )
        # Acceptance over every request this engine verified drafts for.
        self.acceptance = AcceptanceStats()
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._released: list[str] = []
        # Submitted, not yet collected: (step, batch, sequences sampled), oldest first.
        self._in_flight: deque[tuple[int, ScheduledBatch, list[Sequence]]] = deque()
        # Steps answered from a captured CUDA graph, and all steps (reported, tested).
        self.graph_steps = 0
        self.steps = 0
        # P/D producer: exports handed to the ranks and not yet settled (the requests'
        # blocks are held until then: ``SequenceStatus.SENDING_KV``).
        self._unsettled = 0
        # P/D producer: blocks handed to the KV sender, over every export (reported).
        self.exported_blocks = 0
        # P/D producer: prompt blocks whose KV landed (with the executor's bytes: /metrics).
        self.kv_blocks_sent = 0

    @property
    def kv_bytes_sent(self) -> int:
        """P/D producer: KV bytes its ranks moved for prompts that landed (0 once shut down)."""
        executor = self.instance.executor
        return 0 if executor is None else executor.kv_bytes_sent

    @property
    def executor(self) -> Executor:
        if self.instance.executor is None:
            raise RuntimeError("this instance has been shut down")
        return self.instance.executor

    def shutdown(self) -> None:
        """Stop the instance's ranks and give their memory back."""
        self.instance.shutdown()

    # -- requests -------------------------------------------------------------------

    def _check_prompt(self, prompt_token_ids: list[int], request_id: str) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens leaves no room under "
                f"max_model_len {self.max_model_len}"
            )
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already running")

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
        kv_target: KVTarget | None = None,
    ) -> str:
        """Queue a request. ``kv_target`` (P/D producer): write the prompt's KV there."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        self._check_prompt(prompt_token_ids, request_id)
        self.scheduler.add(Sequence(
            request_id=request_id, token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids), sampling=sampling, kv_target=kv_target,
        ))
        return request_id

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks; False when it is not in flight."""
        if self.fail_remote(request_id, "abort"):
            return True
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        exporting = seq.kv_target is not None and seq.in_flight and seq.sampled_at == seq.last_step
        if seq.status is SequenceStatus.SENDING_KV or exporting:
            # its KV may be on the way out of these blocks: they are freed once it settles
            seq.finish_reason = "abort"
            if seq in self.scheduler.running:
                self.scheduler.running.remove(seq)
            return True
        self.scheduler.finish(seq, "abort")
        self._released.append(request_id)
        self.detokenizer.forget(request_id)
        return True

    def drop(self, request_id: str) -> Sequence | None:
        """P/D producer: abort a consumer's request; its Sequence while a step or its export
        may still write into the consumer's blocks (until ``holds_blocks`` is False), else None."""
        seq = self.scheduler.find(request_id)
        self.abort(request_id)
        return seq if seq is not None and seq.holds_blocks else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight) or self._unsettled > 0

    @property
    def awaiting_kv(self) -> dict[str, Sequence]:
        """P/D consumer: requests whose prompt KV is on its way, by id."""
        return {rid: seq for rid, seq in self.scheduler.transfers.items()
                if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV}

    # -- stepping -------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """One turn of the loop for a caller that drives this instance alone: submit, then
        collect. One TokenOutput per new token."""
        self.submit()
        return self.collect()

    def submit(self) -> bool:
        """Schedule and submit steps until the runner's pipeline is full (one step per PP
        stage; two under overlap scheduling; one otherwise). With one process per rank this
        returns once the ranks have the step, so a caller driving two instances (P/D in one
        process) has both compute at once; the in-process executor runs the step here, or,
        under overlap scheduling, launches it and returns. True when a step is in flight."""
        self._fill_pipeline()
        return bool(self._in_flight)

    def collect(self, wait: bool = True) -> list[TokenOutput]:
        """Wait for the oldest step in flight and sample from it: one TokenOutput per new
        token. P/D producer: also the first token of every prompt whose KV settled since
        (``kv_settled``); with no step in flight this waits for one to settle (``wait``:
        False takes only those settled already)."""
        stepped = bool(self._in_flight)
        outputs = self._collect_step() if stepped else []
        return outputs + self._settle_exports(wait=wait and not stepped)

    def _collect_step(self) -> list[TokenOutput]:
        number, batch, sampled = self._in_flight.popleft()
        result = self.executor.collect()
        self.steps += 1
        self.graph_steps += result.cuda_graph
        for seq in batch.seqs:
            seq.in_flight = seq.last_step > number  # overlap: also in a later step
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, batch.num_drafts, strict=True):
            if not seq.finished:  # finished in flight: its token is dropped, its blocks freed below
                seq.num_computed_tokens += n - d  # accepted drafts count once appended
                self.blocks.commit(seq)
        _gather_prompt_logprobs(batch.seqs, result.prompt_logprobs)
        counts = result.num_emitted or [1] * len(sampled)
        drafts = result.draft_ids or [[] for _ in sampled]
        tops = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in result.top_logprobs] or None
        samples = {id(seq) for seq in sampled}
        offered = [d for seq, d in zip(batch.seqs, batch.num_drafts, strict=True) if id(seq) in samples]
        outputs, at = [], 0
        for seq, count, d, nxt in zip(sampled, counts, offered, drafts, strict=True):
            run = list(zip(result.token_ids[at:at + count], result.logprobs[at:at + count],
                           tops[at:at + count] if tops else [None] * count, strict=True))
            at += count
            if seq.kv_target is not None and seq.first_sample is None:  # its export left with this step
                outputs += self._hold_for_export(seq, run[0])
                continue
            if seq.finished:
                continue
            if self.speculative and seq.num_output_tokens > 0:  # a decode step: it verified d drafts
                seq.acceptance.record(d, count - 1)
                self.acceptance.record(d, count - 1)
            outputs += self._emit_run(seq, run)
            if not seq.finished:
                seq.draft_ids = nxt
        for seq in batch.seqs:
            if seq.finished and not seq.in_flight:  # no step writes into its blocks any more
                self.blocks.free(seq)
        return outputs

    def _emit_run(self, seq: Sequence, run: list[tuple[int, float, list | None]]) -> list[TokenOutput]:
        """Append a step's tokens (accepted drafts, then one) up to a stop: each accepted
        draft's K/V came from this step's forward, so it is computed once appended."""
        outputs = []
        for i, (token, logprob, top) in enumerate(run):
            outputs.append(self._emit(seq, token, logprob, top))
            if seq.finished:
                break
            if i < len(run) - 1:
                seq.num_computed_tokens += 1
        if len(run) > 1 and not seq.finished:
            self.blocks.commit(seq)
        return outputs

    def _emit(self, seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]] | None = None,
              ) -> TokenOutput:
        """Append a sampled token, finish the sequence if it ends here, report it (the
        first token also carries what the request learnt of its prompt)."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.sampling.logprobs is not None:
            seq.top_logprobs.append(top or [])
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._released.append(seq.request_id)
        stats = seq.acceptance
        out = TokenOutput(
            request_id=seq.request_id, index=seq.num_output_tokens - 1, token_id=token,
            logprob=logprob, text=self.detokenizer.delta(seq), finished=seq.finished,
            finish_reason=seq.finish_reason, num_drafted=stats.proposed, num_accepted=stats.accepted,
            num_verify_steps=stats.verify_steps,
            top_logprobs=(top or []) if seq.sampling.logprobs is not None else None,
        )
        if out.index == 0:
            out.num_cached_tokens = seq.num_cached_tokens
            if seq.sampling.prompt_logprobs is not None:
                out.prompt_logprobs = list(seq.prompt_logprobs)
                out.prompt_top_logprobs = list(seq.prompt_top_logprobs)
        return out

    # -- P/D producer: blocks held until the prompt's KV is sent ---------------------------

    def _hold_for_export(self, seq: Sequence, sample: tuple[int, float, list | None]) -> list[TokenOutput]:
        """The step that completed ``seq``'s prompt is back and its export on the way: keep
        the token and the blocks (the sender reads them) until the export settles."""
        seq.first_sample = sample
        reason = seq.finish_reason  # "abort" when aborted while the step was in flight
        self.scheduler.park(seq, SequenceStatus.SENDING_KV)
        seq.finish_reason = reason
        return self._sent(seq) if seq.kv_settled else []

    def _settle_exports(self, wait: bool) -> list[TokenOutput]:
        """The exports the ranks report settled (waiting for one when ``wait``)."""
        if not self._unsettled:
            return []
        outputs = []
        settled = self.executor.settled(self.parallel.step_timeout_s if wait else 0.0)
        for request_id, error in settled.items():
            self._unsettled -= 1
            seq = self.scheduler.find(request_id)
            if seq is None:
                continue
            seq.kv_settled, seq.kv_error = True, error
            if error is None and seq.kv_target is not None:
                self.kv_blocks_sent += len(seq.kv_target.blocks)
            if seq.status is SequenceStatus.SENDING_KV:
                outputs += self._sent(seq)
        return outputs

    def _sent(self, seq: Sequence) -> list[TokenOutput]:
        """The KV has settled: free the blocks, and report the prompt's token with the
        transfer's verdict (nothing for a request aborted meanwhile)."""
        self.scheduler.transfers.pop(seq.request_id)
        if seq.finish_reason == "abort":
            seq.status = SequenceStatus.FINISHED
            self.blocks.free(seq)
            self._released.append(seq.request_id)
            self.detokenizer.forget(seq.request_id)
            return []
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)  # _emit finishes it there (max_tokens=1)
        out = self._emit(seq, *seq.first_sample)  # finished there: its blocks go back
        out.kv_settled, out.kv_error = True, seq.kv_error
        return [out]

    # -- P/D: a consumer admits a request whose prompt KV another instance writes -------

    def pair(self, endpoints: list[KVEndpoint], consumer: str) -> list[TokenOutput]:
        """P/D producer: pair with one more consumer instance (``Instance.pair``). Control
        goes between steps, so the steps in flight are collected first (their outputs are
        returned); requests for other consumers, exports in flight included, go on."""
        outputs = self._collect_in_flight()
        self.instance.pair(endpoints, consumer)
        return outputs

    def forget(self, consumer: str) -> list[TokenOutput]:
        """P/D producer: let go of a consumer instance's peers (``Instance.forget``), the
        steps in flight collected first (their outputs are returned); exports in flight
        settle before its peers close, and are reported as usual."""
        outputs = self._collect_in_flight()
        self.instance.forget(consumer)
        return outputs

    def _collect_in_flight(self) -> list[TokenOutput]:
        """Control goes between steps: collect every step in flight."""
        outputs = []
        while self._in_flight:
            outputs += self._collect_step()
        return outputs

    def add_remote_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, *,
        reuse_prefix: bool = False,
    ) -> list[int] | None:
        """Allocate blocks for the prompt and park the request until its KV has arrived;
        returns the prompt's block ids, or None when the pool is short now (try again
        after some requests finish). ``reuse_prefix``: the leading blocks come from this
        instance's prefix cache (``num_cached_tokens`` of the parked sequence says how
        many tokens), and the producer writes only the blocks after them."""
        self._check_prompt(prompt_token_ids, request_id)
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), sampling=sampling)
        seq.num_cached_tokens = self.blocks.match_prefix(seq) if reuse_prefix else 0
        if not self.blocks.allocate(seq, seq.num_tokens):
            self.blocks.hit_tokens -= seq.num_cached_tokens  # not admitted: no hit yet
            self.blocks.free(seq)  # the matched prefix blocks, if any
            return None
        self.scheduler.park(seq, SequenceStatus.WAITING_FOR_REMOTE_KV)
        return list(seq.block_table)

    def complete_remote_prefill(self, request_id: str, token: int, logprob: float,
                                first: TokenOutput | None = None) -> TokenOutput:
        """The prompt's KV is in this instance's blocks and the producer sampled ``token``:
        decode on from there, as if this instance had prefilled itself. ``first``: the
        producer's report of that token, whose logprobs travel on (the prefix-cache hits
        reported are this instance's: the prompt tokens whose KV did not move)."""
        seq = self.scheduler.unpark(request_id, SequenceStatus.WAITING_FOR_REMOTE_KV)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        if first is not None:
            seq.prompt_logprobs = list(first.prompt_logprobs or [])
            seq.prompt_top_logprobs = list(first.prompt_top_logprobs or [])
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.blocks.commit(seq)
        self.blocks.mark_producer_held(seq)
        seq.status = SequenceStatus.RUNNING
        seq.fresh = True  # the drafter adopts the prompt's transferred draft context
        self.scheduler.running.append(seq)
        return self._emit(seq, token, logprob, first.top_logprobs if first is not None else None)

    def fail_remote(self, request_id: str, reason: str = "error") -> bool:
        """The prompt's KV will not come (producer gone, transfer failed): free its blocks."""
        seq = self.scheduler.unpark(request_id, SequenceStatus.WAITING_FOR_REMOTE_KV)
        if seq is None:
            return False
        self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return True

    def _fill_pipeline(self) -> None:
        """With D steps in flight, each takes about 1/D of the unfinished sequences, so
        the running ones spread over the stages instead of all riding the first step."""
        depth = self.executor.depth
        while len(self._in_flight) < depth:
            unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
            # Overlap: every sequence rides every step (one step launched ahead, not spread).
            cap = None if depth == 1 or self.executor.overlap else max(1, -(-unfinished // depth))
            batch = self.scheduler.schedule(max_seqs=cap)
            if batch.empty:
                return
            number = next(self._steps)
            step, sampled = build_step_input(
                batch, block_size=self.parallel.block_size, step=number,
                released=self._released, speculative=self.speculative,
            )
            self._released = []
            self.executor.submit(step)
            self._unsettled += len(step.exports)
            self.exported_blocks += sum(len(e.dst_blocks) for e in step.exports)
            for seq in batch.seqs:
                seq.in_flight, seq.last_step = True, number
                seq.fresh = False
            for index, seq in enumerate(sampled):
                seq.sampled_at, seq.sample_index = number, index
            self._in_flight.append((number, batch, sampled))

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if self.detokenizer.find_stop(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- reporting ------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage


def _gather_prompt_logprobs(seqs: list[Sequence], scored: list[PromptLogprobs]) -> None:
    """Append a step's prompt logprobs to their sequences (chunks arrive in order)."""
    if not scored:
        return
    by_id = {seq.request_id: seq for seq in seqs}
    for part in scored:
        seq = by_id[part.request_id]
        seq.prompt_logprobs += part.logprobs
        tops = part.top or [None] * len(part.logprobs)
        seq.prompt_top_logprobs += [list(zip(t.token_ids, t.logprobs, strict=True)) if t else [] for t in tops]
