"""One serving instance: model + KV binding + scheduler + sampler, stepped by its owner."""

from __future__ import annotations

import itertools

import torch

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import (
    TORCH_DTYPES,
    KVCacheBinding,
    bytes_per_block,
    local_unit_specs,
)
from pdflow.engine.block_manager import BlockManager
from pdflow.engine.detokenizer import Detokenizer
from pdflow.engine.kv_budget import derive_num_kv_blocks
from pdflow.engine.model_runner import ModelRunner
from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.scheduler import Scheduler
from pdflow.engine.sequence import Sequence
from pdflow.model.config import DecoderConfig
from pdflow.model.loader import build_model
from pdflow.model.paths import resolve_model_path
from pdflow.model.tokenizer import load_tokenizer
from pdflow.spec import ModelSpec, ParallelSpec
from pdflow.spec.dtypes import canonical_dtype


class LLMEngine:
    """``model``: a checkpoint folder (``pdflow:...`` for a packaged one), or a ModelSpec
    without a path for a randomly initialised model of that geometry."""

    def __init__(
        self, model: str | ModelSpec, parallel: ParallelSpec, *, dtype: str = "auto",
        max_model_len: int | None = None, seed: int = 0,
    ):
        if parallel.tp != 1 or parallel.pp != 1:
            raise NotImplementedError("one engine instance is TP1/PP1 for now")
        if parallel.kv_page_tokens is None:
            raise ValueError("set parallel.kv_page_tokens: every KV binding declares its page")
        self.parallel = parallel
        self.device = torch.device(parallel.device)
        folder, cfg = self._locate(model)
        if dtype == "auto":
            dtype = cfg.torch_dtype or "float32"
        self.dtype = canonical_dtype(dtype)
        self.config = cfg
        self.model = build_model(
            cfg, folder=folder, dtype=TORCH_DTYPES[self.dtype], device=self.device, seed=seed
        )
        self.tokenizer = load_tokenizer(folder) if folder is not None else None
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        kv_dtype = self.dtype if parallel.kv_dtype == "auto" else canonical_dtype(parallel.kv_dtype)
        units = local_unit_specs(
            layers=self.model.layer_range, num_kv_heads=cfg.num_kv_heads, tp_rank=0, tp_size=1,
            head_dim=cfg.head_dim, dtype=kv_dtype, page_tokens=parallel.kv_page_tokens,
            block_size=parallel.block_size,
        )
        wanted_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        num_blocks = derive_num_kv_blocks(
            parallel, bytes_per_block=bytes_per_block(units), weight_bytes=weight_bytes,
            max_model_len=wanted_len, device=self.device,
        )
        # One sequence must always fit in the pool, or preemption could never free enough.
        self.max_model_len = min(wanted_len, num_blocks * parallel.block_size)
        self.kv = KVCacheBinding(units, num_blocks, self.device)
        self.kv.bind(self.model.attention_layers(), get_backend(parallel.attention_backend))
        self.blocks = BlockManager(
            num_blocks=num_blocks, block_size=parallel.block_size,
            enable_prefix_caching=parallel.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.blocks, max_num_batched_tokens=parallel.max_num_batched_tokens,
            max_num_seqs=parallel.max_num_seqs,
        )
        self.runner = ModelRunner(self.model, block_size=parallel.block_size, device=self.device)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()

    @staticmethod
    def _locate(model: str | ModelSpec):
        if isinstance(model, ModelSpec):
            if model.path is None:
                return None, DecoderConfig.from_model_spec(model)
            model = model.path
        folder = resolve_model_path(model)
        return folder, DecoderConfig.from_file(folder)

    # -- requests -------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> str:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens leaves no room under "
                f"max_model_len {self.max_model_len}"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already running")
        self.scheduler.add(Sequence(
            request_id=request_id, token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids), sampling=sampling,
        ))
        return request_id

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks; False when it is not in flight."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.detokenizer.forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping -------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """Schedule, run the model once, sample; one TokenOutput per new token."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        sampled, tokens, logprobs = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
        outputs = []
        for seq, token, logprob in zip(sampled, tokens, logprobs, strict=True):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(TokenOutput(
                request_id=seq.request_id, index=seq.num_output_tokens - 1, token_id=token,
                logprob=logprob, text=self.detokenizer.delta(seq), finished=seq.finished,
                finish_reason=seq.finish_reason,
            ))
        return outputs

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
