"""Names of the dtypes a spec may use, and their sizes, without importing torch."""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

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
    return DTYPE_BYTES[canonical_dtype(name)]
