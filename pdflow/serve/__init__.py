"""Serving over HTTP: the OpenAI-compatible API of one instance, the router in front of
instances, and launching them from a run spec.

``ServingBackend`` (backend.py) is the one seam to the engine side; ``LLMBackend`` adapts
``pdflow.LLM``. Modules import FastAPI/uvicorn and the engine lazily from here on.
"""
