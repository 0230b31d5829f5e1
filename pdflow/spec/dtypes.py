"""Names of the dtypes a spec may use, and their sizes, without importing torch."""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

# Storage-only dtypes: never a user's dtype, only what the graph gives scale units.
# ``e8m0`` is one byte holding a biased power-of-two exponent (OCP MX's scale format).
STORAGE_BYTES: dict[str, int] = {**DTYPE_BYTES, "e8m0": 1}

# KV dtypes stored with a scale per (token, KV head), and the scale units' dtype. Why per
# token-head and a power of two (docs/ARCHITECTURE.md, 'KV units, pages and the head cut'): the
# scale is computed from the token's own values as it is written, so no calibration and
# no requantizing of a page when later tokens arrive; a power-of-two scale makes
# dequantizing exact and costs one byte per head_dim bytes (d64: 65 bytes for bf16's 128),
# and fp8 keeps its 3-bit relative precision whatever the scale, so nothing is lost.
SCALED_KV_DTYPES: dict[str, str] = {"fp8_e4m3": "e8m0"}
# KV dtypes the engine stores (a plan may describe others; a run refuses them).
ENGINE_KV_DTYPES = frozenset({"fp32", "bf16", "fp16", "fp8_e4m3"})

ALIASES: dict[str, str] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float": "fp32",
}


def canonical_dtype(name: str, key: str = "dtype") -> str:
    """Map user spellings (``bfloat16``) onto the spec's short names (``bf16``); ``key``
    names the setting in the error."""
    short = ALIASES.get(name, name)
    if short not in DTYPE_BYTES:
        raise ValueError(f"{key} {name!r} is not a dtype; use one of {', '.join(DTYPE_BYTES)}")
    return short


def dtype_bytes(name: str) -> int:
    if name in STORAGE_BYTES:
        return STORAGE_BYTES[name]
    return DTYPE_BYTES[canonical_dtype(name)]


def kv_scale_dtype(kv_dtype: str) -> str | None:
    """The dtype of the scale units a KV cache of ``kv_dtype`` carries; None: no scales."""
    return SCALED_KV_DTYPES.get(kv_dtype)
