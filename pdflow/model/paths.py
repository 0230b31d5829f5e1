"""Where a model lives: ``pdflow:<folder>`` names a folder shipped inside the package.

The resolution is the spec's (pdflow.spec.checkpoint), so the graph, which reads the
checkpoint's config.json at plan time, and the loader find the same folder.
"""

from __future__ import annotations

from pdflow.spec.checkpoint import PACKAGE_PREFIX, model_name, resolve_model_path

__all__ = ["PACKAGE_PREFIX", "model_name", "resolve_model_path"]
