"""The drafter interface a worker calls, and who calls what (producer vs consumer).

Each step, on the rank(s) that hold the drafter (the last stage; every TP rank of it):

1. after the target forward (a prefill chunk, or a verify of [anchor, drafts]; on a
   producer too): ``write_context_kv(ContextBatch)`` with the step's rows and their
   features (the relayed taps, or the last hidden state for eagle);
2. ``verify`` the drafts against the target's k+1 logits per request (or sample as
   usual when there were none);
3. ``commit(seq_ids, num_tokens)``: tokens [0, num_tokens) are final (the chunk's end,
   or anchor position + accepted + 1); rows written for rejected drafts are dropped
   (their slots are rewritten by the next step);
4. for the next step: ``propose(ProposeBatch)`` -> ``Proposal``, k drafts from the last
   emitted token (the anchor), which the next target forward scores with it.

A producer never keeps drafts: with a ``context_kv_only`` drafter (dspark) it skips
propose entirely; with eagle it proposes once after its final chunk only because that
step writes the last context entry (see ``DraftDuties``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pdflow.graph.heads import rank_heads
from pdflow.graph.placement import PRODUCER
from pdflow.graph.run_graph import DrafterPlan
from pdflow.graph.units import DRAFT, UnitSpec
from pdflow.spec_decode.config import DrafterConfig
from pdflow.spec_decode.ledger import ContextLedger
from pdflow.spec_decode.sampling import SamplingBatch


class DraftPlacementMismatch(ValueError):
    """The draft units the graph placed on this rank do not fit the drafter built here."""


class ContextFeatureMismatch(ValueError):
    """The features a worker passed are not the ones this drafter reads."""


@dataclass(kw_only=True, slots=True)
class ContextBatch:
    """One target forward's rows, as the drafter needs them (target order, flattened)."""

    seq_ids: list[str]
    # [B+1] host: row offsets of each request; its rows sit at consecutive positions.
    cu_seqlens: list[int]
    start_positions: list[int]  # host: position of each request's first row
    # [T, feature_size]: dspark/eagle3 the taps side by side in tap order (what the PP
    # relay carries), eagle the target's final normed hidden state.
    features: torch.Tensor
    positions: torch.Tensor  # [T] int64
    # [T] int64: the target's slots; the draft pool rides the target's block ids.
    slot_mapping: torch.Tensor
    token_ids: torch.Tensor  # [T] int64: the forward's input tokens
    # Chain drafters: per request the token after its last row (the next prompt token of
    # a non-final chunk), or -1 when it is not known yet (it is about to be sampled).
    next_token_ids: list[int] | None = None


@dataclass(kw_only=True, slots=True)
class ProposeBatch:
    seq_ids: list[str]
    anchor_ids: torch.Tensor  # [B] int64: the last emitted token (not yet through the target)
    anchor_positions: list[int]  # host: its position P (= tokens before it)
    block_tables: torch.Tensor  # [B, max_blocks] int32, covering positions up to P + k
    num_drafts: int
    # Chain drafters: the feature of the row just before the anchor (the one that
    # sampled it), [B, feature_size]; dspark reads only its context K/V.
    anchor_features: torch.Tensor | None = None
    sampling: SamplingBatch | None = None
    generator: torch.Generator | None = None


@dataclass(kw_only=True, slots=True)
class Proposal:
    tokens: torch.Tensor  # [B, k] int64
    probs: torch.Tensor | None  # [B, k, V]: what sampled drafts were drawn from; None: argmax
    logits: torch.Tensor  # [B, k, V]: the draft logits (tests, diagnostics)


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftDuties:
    """What one instance's drafter rank does each step (data, not branches in a worker)."""

    write_context_kv: bool  # after every target forward
    propose: bool  # after a step that sampled a token
    keep_drafts: bool  # verify the drafts (consumer) or drop them (producer)
    warmup_propose: bool  # include propose in warmup / graph capture
    commit: bool  # after every target step


def duties(plan: DrafterPlan, role: str) -> DraftDuties:
    """The graph decides whether a producer proposes (``DrafterPlan.producer_proposes``)."""
    if role == PRODUCER:
        return DraftDuties(write_context_kv=True, propose=plan.producer_proposes, keep_drafts=False,
                           warmup_propose=plan.producer_proposes, commit=True)
    return DraftDuties(write_context_kv=True, propose=True, keep_drafts=True, warmup_propose=True, commit=True)


class Drafter(nn.Module):
    """Base of dspark, eagle and eagle3: the interface, the ledger, target sharing, caches."""

    kind: ClassVar[str]
    context_kv_only: ClassVar[bool]
    # Entries lag tokens by this much: a chain drafter's entry t needs token t+1.
    context_lag: ClassVar[int]
    # Whether a steady greedy step's context write and proposal run from device tensors
    # alone (``write_context_device``, ``propose_device``: no host read, no ledger), so a
    # worker may capture them in a CUDA graph and keep the ledger itself.
    graphable: ClassVar[bool] = False

    def __init__(self, config: DrafterConfig, draft_units: Sequence[UnitSpec], *, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__()
        if config.kind != self.kind:
            raise ValueError(f"a {config.kind} config cannot build a {self.kind} drafter")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.units = _check_units(config, draft_units, tp_rank, tp_size)
        self.ledger = ContextLedger(self.kind)
        self._shared: tuple[nn.Module, nn.Module] | None = None  # not submodules: not saved
        self.caches: Mapping[tuple[int, str], torch.Tensor] | None = None
        self.backend = None

    # -- wiring ------------------------------------------------------------------------

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs feed ``features``; () means the last hidden state."""
        return self.config.tap_layers

    @property
    def block_size(self) -> int:
        return self.units[(0, "k")].block_size

    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Share the target's embedding (ids -> hidden) and LM head (hidden -> full-vocab
        logits on every rank)."""
        self._shared = (embed_tokens, lm_head)

    def bind_cache(self, caches: Mapping[tuple[int, str], torch.Tensor], backend) -> None:
        """The draft pool (e.g. ``KVCacheBinding(draft_units, ...).caches``, keyed
        (row, field)) and the attention backend."""
        for key, unit in self.units.items():
            cache = caches[key]
            if tuple(cache.shape[1:]) != unit.cache_shape(1)[1:]:
                raise DraftPlacementMismatch(f"{unit.name}: cache {tuple(cache.shape)} is not laid out "
                                             f"as {unit.cache_shape(cache.shape[0])}")
        self.caches, self.backend = caches, backend

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target()[0](ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target()[1](hidden)

    def _target(self) -> tuple[nn.Module, nn.Module]:
        if self._shared is None:
            raise RuntimeError(f"{self.kind} drafter: bind_target(embed_tokens, lm_head) first")
        return self._shared

    def _cache(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.caches is None:
            raise RuntimeError(f"{self.kind} drafter: bind_cache(caches, backend) first")
        return self.caches[(row, "k")], self.caches[(row, "v")]

    def _scales(self, row: int) -> dict[str, torch.Tensor]:
        """An fp8 pool's scale caches as the backend's keywords ({} for a 16/32-bit pool)."""
        if (row, "k_scale") not in self.caches:
            return {}
        return {"k_scale": self.caches[(row, "k_scale")], "v_scale": self.caches[(row, "v_scale")]}

    # -- the interface -----------------------------------------------------------------

    def check_runtime(self, *, pp: int) -> None:
        """Refuse an instance this drafter cannot serve (eagle3 under PP)."""

    def write_context_kv(self, batch: ContextBatch) -> None:
        """Write this forward's context entries into the draft pool."""
        self.check_features(batch.features)
        self.record_context_write(batch.seq_ids, batch.cu_seqlens, batch.start_positions, batch.next_token_ids)
        self._write_context(batch)

    def check_features(self, features: torch.Tensor) -> None:
        width = features.shape[-1]
        if width != self.config.feature_size:
            reads = (f"taps {list(self.tap_layers)} side by side" if self.tap_layers
                     else "the target's final hidden state")
            raise ContextFeatureMismatch(
                f"{self.kind} drafter reads {reads} ({self.config.feature_size} wide), got {width}"
            )

    def record_context_write(self, seq_ids: Sequence[str], cu_seqlens: Sequence[int],
                             start_positions: Sequence[int], next_token_ids: Sequence[int] | None = None) -> None:
        """The ledger's part of ``write_context_kv`` (host ints; raises ``ContextGap``
        before anything is written). A worker that writes through ``write_context_device``
        calls it itself."""
        cu = cu_seqlens
        for i, sid in enumerate(seq_ids):
            start = start_positions[i]
            end = start + cu[i + 1] - cu[i]
            stop = end
            if self.context_lag and (next_token_ids is None or next_token_ids[i] < 0):
                stop -= self.context_lag
            self.ledger.wrote(sid, start, stop, end)

    def require_context(self, seq_ids: Sequence[str], anchor_positions: Sequence[int]) -> None:
        """The ledger's check before a proposal from each anchor: its context is committed."""
        for sid, pos in zip(seq_ids, anchor_positions, strict=True):
            self.ledger.require(sid, pos - self.context_lag, "propose")

    def propose(self, batch: ProposeBatch) -> Proposal:
        self.require_context(batch.seq_ids, batch.anchor_positions)
        proposal = self._propose(batch)
        if self.context_lag:
            for sid, pos in zip(batch.seq_ids, batch.anchor_positions, strict=True):
                self.ledger.extend(sid, pos)
        return proposal

    def commit(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        """After a target step: tokens [0, n) of each request are final (prompt chunk
        done, or anchor + accepted drafts); entries past them are dropped."""
        for sid, n in zip(seq_ids, num_tokens, strict=True):
            # A chain entry pairs a row with the next token: the forward's own token (a
            # draft, final only when accepted) or the worker's next_token (final).
            inside = n < self.ledger.forward_end.get(sid, n)
            self.ledger.commit(sid, n - self.context_lag if inside else n)

    def rollback(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        """Forget entries from token n on (preemption frees blocks: n = 0)."""
        for sid, n in zip(seq_ids, num_tokens, strict=True):
            self.ledger.rollback(sid, max(0, n - self.context_lag))

    def adopt(self, seq_id: str, entries: int) -> None:
        """Entries [0, entries) are already in the pool (prefix-cache hit, or imported
        from a producer, whose ``context_entries`` says how many it wrote)."""
        self.ledger.adopt(seq_id, entries)

    def context_entries(self, seq_id: str) -> int:
        return self.ledger.valid.get(seq_id, 0)

    def release(self, seq_ids: Sequence[str]) -> None:
        self.ledger.release(seq_ids)

    # -- device-only parts (``graphable`` drafters) ---------------------------------------

    def write_context_device(self, features: torch.Tensor, positions: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
        """``write_context_kv`` without the ledger (the caller records the entries)."""
        raise NotImplementedError(f"{self.kind} drafter cannot write its context from device tensors alone")

    def propose_device(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                       block_tables: torch.Tensor, num_drafts: int) -> Proposal:
        """A greedy ``propose`` from device tensors (anchor_positions [B] int64), without
        the ledger (the caller checks ``require_context`` once the positions are known)."""
        raise NotImplementedError(f"{self.kind} drafter cannot propose from device tensors alone")

    # -- per kind ----------------------------------------------------------------------

    def _write_context(self, batch: ContextBatch) -> None:
        raise NotImplementedError

    def _propose(self, batch: ProposeBatch) -> Proposal:
        raise NotImplementedError


def _check_units(config: DrafterConfig, units: Sequence[UnitSpec], tp_rank: int, tp_size: int):
    """The graph's draft units for this rank, keyed (row, field), checked against the
    heads this rank's projections hold (``rank_heads``, as the target's)."""
    drafts = {(u.layer, u.field): u for u in units if u.family == DRAFT}
    want = {(row, f) for row in range(config.num_layers) for f in ("k", "v")}
    scaled = {(row, f) for row in range(config.num_layers) for f in ("k_scale", "v_scale")}
    if set(drafts) - scaled != want or (scaled & set(drafts)) not in (set(), scaled):
        raise DraftPlacementMismatch(
            f"rank {tp_rank}: draft units {sorted(drafts)} are not k/v of rows 0..{config.num_layers - 1}; "
            "build the drafter from graph.rank(role, rank).units on the rank that holds it"
        )
    heads = rank_heads(config.num_kv_heads, tp_size, tp_rank)
    for unit in drafts.values():
        head_dim = 1 if unit.field.endswith("_scale") else config.head_dim
        if unit.heads != heads or unit.head_dim != head_dim:
            raise DraftPlacementMismatch(
                f"{unit.name} holds heads {unit.heads} x d{unit.head_dim} but tp rank {tp_rank}/{tp_size} "
                f"of this drafter projects heads {heads} x d{config.head_dim}"
            )
    return drafts
