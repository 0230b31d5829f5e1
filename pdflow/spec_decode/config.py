"""A drafter checkpoint's geometry (its ``config.json``), and the checks against the run.

The config is HF-shaped (architectures, hidden_size, num_hidden_layers, ...) plus what
a drafter needs: its kind, the target layers it taps, the number of draft tokens it was
trained for and the target it was trained against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdflow.model.config import DecoderConfig

ARCHITECTURES = {
    "dspark": "PdflowDSparkDrafter",
    "eagle": "PdflowEagleDrafter",
    "eagle3": "PdflowEagle3Drafter",
}
MODEL_TYPE = "pdflow_drafter"


class DrafterConfigMismatch(ValueError):
    """The run's drafter spec (or graph) disagrees with the drafter checkpoint."""


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # Target layers whose output (residual stream after the layer) the drafter reads;
    # dspark and eagle3 only (eagle reads the target's final normed hidden state).
    tap_layers: tuple[int, ...] = ()
    # dspark: the block size it was trained for; chains: the unrolled steps trained.
    num_speculative_tokens: int = 7
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    qk_norm: bool = False
    attention_bias: bool = False
    torch_dtype: str | None = None
    # Free-form provenance (the training record): not geometry.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ARCHITECTURES:
            raise ValueError(f"drafter kind {self.kind!r} is not one of {tuple(ARCHITECTURES)}")
        self.tap_layers = tuple(int(t) for t in self.tap_layers)
        if self.kind in ("dspark", "eagle3") and not self.tap_layers:
            raise ValueError(f"a {self.kind} drafter config must name its tap_layers")
        if self.kind == "eagle" and self.tap_layers:
            raise ValueError("an eagle drafter reads the target's last hidden state, not tap_layers")
        if self.kind != "dspark" and self.num_layers != 1:
            raise ValueError(f"a {self.kind} drafter is one decoder layer, not {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads over {self.num_kv_heads} KV heads is not GQA")

    @property
    def feature_size(self) -> int:
        """Width of the target features one row brings: the taps side by side (tap order),
        or the last hidden state."""
        return self.hidden_size * max(1, len(self.tap_layers))

    def decoder_config(self) -> DecoderConfig:
        """The geometry of one draft layer, in the model package's terms."""
        return DecoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, qk_norm=self.qk_norm,
            attention_bias=self.attention_bias,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURES[self.kind]],
            "model_type": MODEL_TYPE,
            "drafter_kind": self.kind,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tap_layers": list(self.tap_layers),
            "num_speculative_tokens": self.num_speculative_tokens,
            "target_num_hidden_layers": self.target_num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "qk_norm": self.qk_norm,
            "attention_bias": self.attention_bias,
            "torch_dtype": self.torch_dtype,
            "pdflow": self.extra,
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type {raw.get('model_type')!r} is not a pdflow drafter ({MODEL_TYPE!r})")
        return cls(
            kind=raw["drafter_kind"], hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"],
            head_dim=raw["head_dim"], intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"], tap_layers=tuple(raw.get("tap_layers") or ()),
            num_speculative_tokens=raw.get("num_speculative_tokens", 7),
            target_num_layers=raw.get("target_num_hidden_layers", 0),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            qk_norm=raw.get("qk_norm", False), attention_bias=raw.get("attention_bias", False),
            torch_dtype=raw.get("torch_dtype"), extra=raw.get("pdflow") or {},
        )

    @classmethod
    def from_file(cls, folder: Path) -> DrafterConfig:
        return cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))

    def check_run(self, *, spec, target: DecoderConfig, graph_taps: tuple[int, ...]) -> None:
        """Refuse a run whose drafter spec, target or graph taps disagree with this
        checkpoint: the graph would size units and relay taps for another drafter."""
        wrong = []
        if spec.kind != self.kind:
            wrong.append(f"kind: spec {spec.kind} vs checkpoint {self.kind}")
        for name, mine in (("layers", self.num_layers), ("kv_heads", self.num_kv_heads),
                           ("head_dim", self.head_dim)):
            if getattr(spec, name) != mine:
                wrong.append(f"{name}: spec {getattr(spec, name)} vs checkpoint {mine}")
        if (target.hidden_size, target.vocab_size) != (self.hidden_size, self.vocab_size):
            wrong.append(f"target hidden/vocab {target.hidden_size}/{target.vocab_size} vs checkpoint "
                         f"{self.hidden_size}/{self.vocab_size} (the drafter shares the target's "
                         "embedding and LM head)")
        if self.target_num_layers and target.num_layers != self.target_num_layers:
            wrong.append(f"target layers {target.num_layers} vs {self.target_num_layers} trained against")
        if self.kind == "dspark" and tuple(graph_taps) != self.tap_layers:
            wrong.append(f"taps: graph {list(graph_taps)} vs checkpoint {list(self.tap_layers)} "
                         f"(set drafter.taps={list(self.tap_layers)})")
        if wrong:
            raise DrafterConfigMismatch("drafter checkpoint disagrees with the run: " + "; ".join(wrong))
