"""Hugging Face hub ids as model paths (``model.path=Qwen/Qwen3-0.6B``), as vLLM and SGLang
take them: resolved through ``huggingface_hub`` into its cache (``HF_HUB_CACHE``), which
honours ``HF_HUB_OFFLINE`` (then only the cache is read, nothing is downloaded).

A plan reads only ``config.json``; loading fetches the files a checkpoint is served from
(configs, safetensors, tokenizer). Both land in one snapshot folder of the cache, so the
graph and the loader read the same checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

# ``org/name``: one slash, hub-legal characters; a path that exists locally wins.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
CONFIG_FILES = ("config.json",)
SERVED_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken")


def is_hub_id(text: str) -> bool:
    """``text`` names a hub repository rather than a folder on this machine."""
    return bool(HUB_ID.match(text)) and not Path(text).expanduser().exists()


def hub_name(repo_id: str) -> str:
    """The model's name for a hub id: the repository's name (``Qwen3-0.6B``)."""
    return repo_id.rsplit("/", 1)[-1]


def hub_snapshot(repo_id: str, revision: str | None = None, *, weights: bool = True) -> Path:
    """The cache folder of ``repo_id`` at ``revision`` (default ``main``), fetched when
    missing and allowed. ``weights=False`` fetches only config.json (what a plan reads).
    Raises FileNotFoundError saying why (offline and not cached, unknown repository)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = list(SERVED_FILES if weights else CONFIG_FILES)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"model {repo_id!r} (revision {revision or 'main'}) is not in the Hugging Face cache and "
            f"cannot be downloaded ({err}); unset HF_HUB_OFFLINE to download it, or point HF_HUB_CACHE "
            "at a cache that holds it") from err
    except (RepositoryNotFoundError, HfHubHTTPError, ValueError) as err:
        raise FileNotFoundError(f"model {repo_id!r} (revision {revision or 'main'}) could not be fetched "
                                f"from the Hugging Face hub: {err}") from err
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"hub snapshot {folder} of {repo_id!r} has no config.json: not a HF "
                                "checkpoint")
    return folder
