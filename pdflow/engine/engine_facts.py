"""What a driver over one ``LLMEngine`` reports about it: the limits and pool a server or
a user reads (``LLM``, ``Deployment`` through its front instance, the P/D instance backends)."""

from __future__ import annotations

from pdflow.engine.llm_engine import LLMEngine


class EngineFacts:
    """Properties read through ``self.engine``; a driver overrides any it answers itself."""

    engine: LLMEngine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.engine.parallel.block_size

    @property
    def num_free_kv_blocks(self) -> int:
        return self.engine.num_free_kv_blocks

    @property
    def startup_s(self) -> float:
        """Seconds from the instance's start to ready (its ranks built and warmed up)."""
        return self.engine.instance.startup_s

    @property
    def compile_s(self) -> float:
        """Of those, seconds spent compiling (the CPU op's build, the ranks' warm-ups)."""
        return self.engine.instance.compile_s
