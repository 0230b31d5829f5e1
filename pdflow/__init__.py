"""pdflow: prefill/decode disaggregated LLM serving from declarative specs."""

__version__ = "0.1.0"
