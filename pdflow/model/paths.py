"""Where a model lives: ``pdflow:<folder>`` names a folder shipped inside the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PACKAGE_PREFIX = "pdflow:"


def resolve_model_path(path: str | Path) -> Path:
    """``pdflow:assets/tiny`` -> that folder of the installed pdflow package; any other
    value is a filesystem path. Raises FileNotFoundError when the folder is missing."""
    text = str(path)
    if text.startswith(PACKAGE_PREFIX):
        inner = text[len(PACKAGE_PREFIX) :].strip("/")
        resolved = Path(str(resources.files("pdflow").joinpath(inner)))
    else:
        resolved = Path(text).expanduser()
    if not resolved.is_dir():
        raise FileNotFoundError(f"model folder {resolved} (from {text!r}) does not exist")
    return resolved
