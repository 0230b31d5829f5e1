"""The offline API: ``LLM(model, parallel).generate(prompts, sampling)`` and ``.stream``."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence

from pdflow.engine.engine_facts import EngineFacts
from pdflow.engine.instance import Instance
from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.outputs import RequestOutput, TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.graph import CONSUMER
from pdflow.model.config import DecoderConfig
from pdflow.model.paths import model_name, resolve_model_path
from pdflow.spec import DrafterSpec, ModelSpec, ParallelSpec, RunSpec
from pdflow.spec.dtypes import canonical_dtype

Prompt = str | list[int]


def run_spec_for(
    model: str | ModelSpec, parallel: ParallelSpec, *, dtype: str = "auto",
    max_model_len: int | None = None, seed: int = 0, revision: str | None = None,
) -> RunSpec:
    """A one-instance run spec: ``model`` as a checkpoint folder (``pdflow:...`` for a
    packaged one), a Hugging Face hub id at ``revision``, or a ModelSpec (no path: random
    init), served with ``parallel``. Only one side runs, so its ranks start at GPU 0
    unless ``parallel.device_offset`` says."""
    if isinstance(model, str):
        folder = resolve_model_path(model, revision)
        cfg = DecoderConfig.from_file(folder)
        if dtype == "auto":
            dtype = cfg.torch_dtype or "float32"
        wanted = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        model = cfg.to_model_spec(
            name=model_name(model), path=model, dtype=canonical_dtype(dtype), max_model_len=wanted
        )
        model.revision = revision
    else:
        model = copy.copy(model)
        if dtype != "auto":
            model.dtype = model.kv_dtype = canonical_dtype(dtype)
        if max_model_len is not None:
            model.max_model_len = max_model_len
    if parallel.device_offset is None:
        parallel = dataclasses.replace(parallel, device_offset=0)
    if parallel.kv_page_tokens is None:  # one instance, no transfer: one page per block
        parallel = dataclasses.replace(parallel, kv_page_tokens=parallel.block_size)
    return RunSpec(
        model=model, prefill=parallel, decode=parallel, drafter=DrafterSpec(), seed=seed,
        name="llm", mode="monolithic",  # one instance: no prefill side placed, sized or counted
    )


def _built_spec(
    model: str | ModelSpec | RunSpec, parallel: ParallelSpec | None, *, dtype: str,
    max_model_len: int | None, seed: int | None, role: str, revision: str | None = None,
) -> RunSpec:
    """``model`` itself when it is a RunSpec (whose building arguments must not be given),
    else the one-instance spec ``run_spec_for`` builds (served as its decode side)."""
    if isinstance(model, RunSpec):
        given = {"parallel": parallel is not None, "dtype": dtype != "auto",
                 "max_model_len": max_model_len is not None, "seed": seed is not None,
                 "revision": revision is not None}
        if any(given.values()):
            names = ", ".join(name for name, g in given.items() if g)
            raise ValueError(f"a RunSpec is already built; {names} cannot be applied to it")
        return model
    if role != CONSUMER:
        raise ValueError(f"role={role!r} needs a RunSpec; a model and parallel serve one decode side")
    parallel = parallel if parallel is not None else ParallelSpec()
    return run_spec_for(
        model, parallel, dtype=dtype, max_model_len=max_model_len, seed=0 if seed is None else seed,
        revision=revision,
    )


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (a string, or a flat list of token ids) becomes a list of one, so
    ``generate("Hello")`` is one request, not one per character."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    return prompts


def token_ids_of(prompt: Prompt, tokenizer, vocab: int) -> list[int]:
    """A prompt as token ids: a string through the checkpoint's tokenizer, or a list of
    in-vocabulary ints as given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token-id lists")
        return tokenizer.encode(prompt)
    ids = list(prompt)
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                or not 0 <= t < vocab), None)
    if bad is not None or isinstance(prompt, dict):
        raise ValueError(f"a prompt is a string or a list of token ids in [0, {vocab}); "
                         f"got {type(prompt).__name__} holding {bad!r}")
    return ids


def requests_of(prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams],
                tokenizer, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt's token ids and sampling (one ``SamplingParams`` for all, or one each),
    every prompt checked before any is queued (``LLM`` and ``Deployment`` submit the same)."""
    prompts = as_prompt_list(prompts)
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    return [(token_ids_of(p, tokenizer, vocab), s) for p, s in zip(prompts, params, strict=True)]


class LLM(EngineFacts):
    """One engine instance driven to completion by this process (its ranks run in their
    own processes when ``parallel`` asks for TP/PP). Prompts are strings (encoded with the
    checkpoint's tokenizer) or token-id lists.

    ``model`` is a checkpoint folder, a Hugging Face hub id (at ``revision``) or a
    ModelSpec served with ``parallel`` (``dtype``, ``max_model_len`` and ``seed`` adjust it), or an already built RunSpec whose ``role``
    side is served as its run graph places it (what ``from_run_spec`` does)."""

    def __init__(
        self, model: str | ModelSpec | RunSpec, parallel: ParallelSpec | None = None, *,
        dtype: str = "auto", max_model_len: int | None = None, seed: int | None = None,
        role: str = CONSUMER, revision: str | None = None,
    ):
        spec = _built_spec(
            model, parallel, dtype=dtype, max_model_len=max_model_len, seed=seed, role=role,
            revision=revision,
        )
        self.instance = Instance(spec, role)
        try:
            self.engine = LLMEngine(self.instance)
        except BaseException:
            self.instance.shutdown()
            raise

    @classmethod
    def from_run_spec(cls, spec: RunSpec, role: str = CONSUMER) -> LLM:
        """One side of a run (the decode side by default), as the run graph places it."""
        if not isinstance(spec, RunSpec):
            raise TypeError(f"from_run_spec needs a RunSpec, got {type(spec).__name__}")
        return cls(spec, role=role)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def submit(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[str]:
        """Queue prompts without running them; returns their request ids. One string, or one
        list of token ids, is one prompt."""
        requests = requests_of(prompts, sampling, self.tokenizer, self.vocab_size)
        return [self.engine.add_request(ids, s) for ids, s in requests]

    def step(self) -> list[TokenOutput]:
        """One engine step: every token it produced (none when nothing is queued)."""
        return self.engine.step() if self.engine.has_unfinished() else []

    def run(self) -> Iterator[TokenOutput]:
        """Step until every queued request has finished, yielding each new token."""
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def stream(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> Iterator[TokenOutput]:
        self.submit(prompts, sampling)
        yield from self.run()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Outputs in prompt order."""
        ids = self.submit(prompts, sampling)
        seqs = {rid: self.engine.scheduler.find(rid) for rid in ids}
        for _ in self.run():
            pass
        return [self._output(seqs[rid]) for rid in ids]

    def _output(self, seq) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids, logprobs=list(seq.logprobs),
            text=self.engine.detokenizer.text(seq), finish_reason=seq.finish_reason,
            num_cached_prompt_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions,
            num_drafted=seq.acceptance.proposed, num_accepted=seq.acceptance.accepted,
            num_verify_steps=seq.acceptance.verify_steps,
            top_logprobs=list(seq.top_logprobs) if seq.sampling.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.sampling.prompt_logprobs is not None else None,
            prompt_top_logprobs=(list(seq.prompt_top_logprobs) if seq.sampling.prompt_logprobs is not None
                                 else None),
        )
