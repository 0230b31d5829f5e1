"""pdflow: prefill/decode disaggregated LLM serving from declarative specs.

``import pdflow`` stays torch-free (the spec/graph/plan path needs no torch); the engine
names below load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pdflow.engine.llm",
    "SamplingParams": "pdflow.engine.sampling_params",
    "Deployment": "pdflow.engine.deployment",
    "compose": "pdflow.spec.load",
}
__all__ = ["LLM", "Deployment", "SamplingParams", "compose", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        attr = "compose_spec" if name == "compose" else name
        value = getattr(importlib.import_module(_LAZY[name]), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdflow' has no attribute {name!r}")
