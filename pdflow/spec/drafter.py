"""Speculative drafter: which kind, its geometry, its KV binding and its taps."""

from __future__ import annotations

from dataclasses import dataclass

from pdflow.spec.dtypes import canonical_dtype

DRAFTER_KINDS = ("none", "dspark", "eagle", "eagle3")


@dataclass(kw_only=True, slots=True)
class DrafterSpec:
    kind: str = "none"
    num_speculative_tokens: int = 0
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    # "auto" follows the target model's dtype.
    dtype: str = "auto"
    # Page of the drafter's context-KV binding; a drafter with layers must declare it.
    page_tokens: int | None = None
    # Target layers whose hidden states feed the drafter (dspark); None: ``num_taps``
    # spaced evenly from layer 1 to L-3, resolved by the graph.
    taps: list[int] | None = None
    num_taps: int = 0
    # False when the taps come from the drafter checkpoint (eagle3): a PP relay
    # carries only taps declared here, so such a drafter is refused under PP.
    taps_declared: bool = True
    # True when context K/V is written apart from propose (dspark): producers skip propose.
    context_kv_only: bool = False
    # Drafter checkpoint folder (``pdflow:...`` or a path). None: the one shipped next to
    # the target (``<model.path>-<kind>``) when it exists, else random weights;
    # "random": random weights (tests: losslessness does not need trained drafts).
    path: str | None = None
    param_count: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter.kind {self.kind!r} is not one of {DRAFTER_KINDS}")
        if self.dtype != "auto":
            canonical_dtype(self.dtype, "drafter.dtype")
        if self.kind == "none":
            return
        for name in ("num_speculative_tokens", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter.{name} must be >= 1 for a {self.kind} drafter")
        if self.taps is not None:
            if self.kind != "dspark":
                raise ValueError(
                    f"drafter.taps is for dspark only; a {self.kind} drafter takes its inputs "
                    "from the target's last hidden state or its checkpoint"
                )
            if len(set(self.taps)) != len(self.taps):
                raise ValueError(f"drafter.taps {list(self.taps)} repeats a layer")
            if list(self.taps) != sorted(self.taps):
                raise ValueError(f"drafter.taps {list(self.taps)} must be in increasing layer order")
        if self.kind == "dspark" and self.taps is None and self.num_taps < 1:
            raise ValueError("a dspark drafter needs drafter.taps or drafter.num_taps >= 1")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def taps_target_layers(self) -> bool:
        """Whether this drafter reads intermediate target layers (not just the last)."""
        return self.kind in ("dspark", "eagle3")
