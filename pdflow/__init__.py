"""pdflow: prefill/decode disaggregated LLM serving from declarative specs.

``import pdflow`` stays torch-free (the spec/graph/plan path needs no torch); the engine
names below load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pdflow.engine.llm",
    "SamplingParams": "pdflow.engine.sampling_params",
}
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdflow' has no attribute {name!r}")
