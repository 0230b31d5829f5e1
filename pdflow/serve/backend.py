"""What the HTTP server needs from whatever generates tokens: one small protocol.

The API server never touches an engine directly; it drives a ``ServingBackend`` from its
engine-loop thread. ``LLMBackend`` adapts anything with ``pdflow.LLM``'s driver API
(``submit``/``run``/``abort``, the KV block counts, ``tokenizer``), so a P/D deployment
with the same methods plugs in unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.serve.pd_wire import RouteRefused

if TYPE_CHECKING:
    from pdflow.serve.pd_wire import PDRoute


@dataclass(kw_only=True, slots=True, frozen=True)
class DraftStats:
    """Speculative decoding counts of one finished request: tokens proposed, tokens
    accepted, and verify forwards (each yields accepted + 1 tokens)."""

    drafted: int
    accepted: int
    verify_steps: int


class DraftCounts:
    """Drafted/accepted counts of finished requests, kept from a step's outputs until the
    server asks for them (every backend that steps an engine reports them the same way)."""

    def __init__(self) -> None:
        self._stats: dict[str, DraftStats] = {}

    def keep(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        for out in outputs:
            if out.finished and out.num_verify_steps:
                self._stats[out.request_id] = DraftStats(
                    drafted=out.num_drafted, accepted=out.num_accepted, verify_steps=out.num_verify_steps)
        return outputs

    def pop(self, request_id: str) -> DraftStats | None:
        return self._stats.pop(request_id, None)


class ServingBackend(Protocol):
    """Called from one thread only (the engine loop), so it needs no locking, except the
    read-only properties, which /metrics and /v1/models read from the server's thread."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self): ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def num_free_kv_blocks(self) -> int: ...

    @property
    def startup_s(self) -> float:
        """Seconds its instances took to be ready, warm-up included."""

    @property
    def compile_s(self) -> float:
        """Of those, seconds spent compiling (before the first request, never in one)."""

    @property
    def block_size(self) -> int:
        """Tokens per KV block (admission reserves whole blocks)."""

    def add(self, prompt_token_ids: list[int], sampling: SamplingParams, *, route: PDRoute | None = None) -> str:
        """Queue one request; returns its id. Raises ValueError for a prompt it refuses,
        and for a ``route`` it cannot serve (only the separate P/D instances' backends
        take one; the others serve every request whole)."""

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[TokenOutput]:
        """Advance the engine; the tokens produced (possibly none). Cheap when idle: it may
        wait a few ms for work it expects (a remote prefill's answer), cut short by ``wake``."""

    def wake(self) -> None:
        """A command (a request, an abort) is waiting for the loop: end any wait inside
        ``step`` now. Called from any thread."""

    def draft_stats(self, request_id: str) -> DraftStats | None:
        """Counts for a request that just finished, or None without a drafter."""

    def shutdown(self) -> None: ...


class LLMBackend:
    """``pdflow.LLM`` or ``pdflow.Deployment`` as a ServingBackend.

    ``step`` is one step of the driver: all of its tokens at once, so a server sends one
    message per step, not one per token."""

    def __init__(self, llm):
        self.llm = llm
        self._draft_counts = DraftCounts()

    # The limits the driver's engine(s) enforce (a pool may cap the model's length).
    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.vocab_size

    @property
    def block_size(self) -> int:
        return self.llm.block_size

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def num_kv_blocks(self) -> int:
        return self.llm.num_kv_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self.llm.num_free_kv_blocks

    @property
    def startup_s(self) -> float:
        return self.llm.startup_s

    @property
    def compile_s(self) -> float:
        return self.llm.compile_s

    def add(self, prompt_token_ids: list[int], sampling: SamplingParams, *, route: PDRoute | None = None) -> str:
        if route is not None:
            raise RouteRefused(f"this server serves every request whole ({type(self.llm).__name__}); it cannot "
                             f"take a P/D route ({route.prefill_at or 'a remote prefill'}): start P/D "
                             "instances with serve.role=prefill|decode behind a router")
        return self.llm.submit([prompt_token_ids], sampling)[0]

    def abort(self, request_id: str) -> bool:
        return self.llm.abort(request_id)

    def step(self) -> list[TokenOutput]:
        return self._draft_counts.keep(self.llm.step())

    def wake(self) -> None:
        """Its ``step`` never waits for anything but the step it runs."""

    def draft_stats(self, request_id: str) -> DraftStats | None:
        """The finished request's drafted/accepted counts (None: it never verified drafts)."""
        return self._draft_counts.pop(request_id)

    def shutdown(self) -> None:
        self.llm.shutdown()
