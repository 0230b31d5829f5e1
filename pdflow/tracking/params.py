"""A resolved config as MLflow params: flat ``a.b.c`` keys, values within MLflow's limits.

MLflow refuses a param key over 250 characters or a value over 6000 (and a whole batch
with it), so long values are cut with a marker and long keys keep a hash of the full
key to stay unique; the untruncated config is logged as an artifact beside them.
Secrets (``api_key``) never leave the process.
"""

from __future__ import annotations

import hashlib

MAX_KEY = 250
MAX_VALUE = 6000
CUT = "...[truncated]"
SECRET_KEYS = ("api_key",)
REDACTED = "<redacted>"


def limits() -> tuple[int, int]:
    """MLflow's own limits when it exposes them (they have grown across versions)."""
    try:
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH

        return MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
    except ImportError:
        return MAX_KEY, MAX_VALUE


def redact(tree):
    """A copy of a config tree with secret values replaced (when set)."""
    if isinstance(tree, dict):
        return {k: (REDACTED if k in SECRET_KEYS and v is not None else redact(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return tree


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """Nested dicts to dotted keys; lists stay values (``[1, 2]``), so a list of any
    length is one param."""
    out: dict[str, object] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value:
                out |= flatten(value, name)
            else:
                out[name] = value
    else:
        out[prefix] = tree
    return out


def fit_key(key: str, max_key: int) -> str:
    if len(key) <= max_key:
        return key
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return key[: max_key - len(digest) - 1] + "~" + digest


def fit_value(value: object, max_value: int) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= max_value else text[: max_value - len(CUT)] + CUT


def config_params(tree: dict) -> dict[str, str]:
    """Redacted, flattened, and cut to MLflow's limits."""
    max_key, max_value = limits()
    return {fit_key(k, max_key): fit_value(v, max_value) for k, v in flatten(redact(tree)).items()}
