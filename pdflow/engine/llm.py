"""The offline API: ``LLM(model, parallel).generate(prompts, sampling)`` and ``.stream``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pdflow.engine.llm_engine import LLMEngine
from pdflow.engine.outputs import RequestOutput, TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.spec import ModelSpec, ParallelSpec, RunSpec

# Used when no ParallelSpec is given: one page per block, as the decode configs have it.
DEFAULT_PARALLEL = dict(block_size=128, kv_page_tokens=128)

Prompt = str | list[int]


class LLM:
    """One engine instance driven to completion in this process. Prompts are strings
    (encoded with the checkpoint's tokenizer) or token-id lists."""

    def __init__(
        self, model: str | ModelSpec, parallel: ParallelSpec | None = None, *,
        dtype: str = "auto", max_model_len: int | None = None, seed: int = 0,
    ):
        parallel = parallel if parallel is not None else ParallelSpec(**DEFAULT_PARALLEL)
        self.engine = LLMEngine(
            model, parallel, dtype=dtype, max_model_len=max_model_len, seed=seed
        )

    @classmethod
    def from_run_spec(cls, spec: RunSpec, **kwargs) -> LLM:
        """The decode side of a run: its model (path, or random init) and parallel spec."""
        kwargs.setdefault("dtype", spec.model.dtype)
        kwargs.setdefault("max_model_len", spec.model.max_model_len)
        kwargs.setdefault("seed", spec.seed)
        return cls(spec.model, spec.decode, **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.num_kv_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self.engine.num_free_kv_blocks

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token-id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def submit(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[str]:
        """Queue prompts without running them; returns their request ids."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        pairs = zip(prompts, params, strict=True)
        return [self.engine.add_request(self._token_ids(p), s) for p, s in pairs]

    def run(self) -> Iterator[TokenOutput]:
        """Step until every queued request has finished, yielding each new token."""
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def stream(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> Iterator[TokenOutput]:
        self.submit(prompts, sampling)
        yield from self.run()

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
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
        )
