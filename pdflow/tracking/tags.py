"""Tags that say how a run was made: chosen config options, overrides, git commit,
hardware. Everything here is best effort: a missing git or GPU is a missing tag."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

CHOICE = "pdflow.choice."
SKIPPED_CHOICE_PREFIXES = ("hydra/",)
COMMIT_ENV = "PDFLOW_GIT_COMMIT"  # names the commit where git cannot (a copied tree)


def hydra_tags() -> dict[str, str]:
    """Chosen group options and the command-line overrides of the current Hydra job."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return {}
        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return {}
    tags = {CHOICE + group: str(option) for group, option in hc.runtime.choices.items()
            if option is not None and not group.startswith(SKIPPED_CHOICE_PREFIXES)}
    overrides = list(hc.overrides.task)
    tags["pdflow.overrides"] = " ".join(overrides)
    if hc.mode is not None and hc.mode.name == "MULTIRUN":
        tags["pdflow.job"] = str(hc.job.num)
    return tags


def git_tags(where: Path | None = None) -> dict[str, str]:
    where = where or Path(__file__).resolve().parent
    if os.environ.get(COMMIT_ENV):  # a copy of the tree without its history names no real commit
        commit = os.environ[COMMIT_ENV]
        return {"mlflow.source.git.commit": commit, "pdflow.git_commit": commit, "pdflow.git_dirty": "unknown"}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"mlflow.source.git.commit": commit, "pdflow.git_commit": commit,
            "pdflow.git_dirty": str(bool(dirty)).lower()}


def hardware_tags() -> dict[str, str]:
    tags = {
        "pdflow.hw.platform": platform.platform(),
        "pdflow.hw.cpu": platform.processor() or platform.machine(),
        "pdflow.hw.cpu_count": str(os.cpu_count()),
        "pdflow.python": sys.version.split()[0],
    }
    torch = sys.modules.get("torch")  # only when the run already loaded it
    if torch is not None:
        tags["pdflow.torch"] = torch.__version__
        if torch.cuda.is_available():
            names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
            tags["pdflow.hw.gpu"] = ", ".join(sorted(names))
            tags["pdflow.hw.gpu_count"] = str(torch.cuda.device_count())
    return tags


def run_tags() -> dict[str, str]:
    return hydra_tags() | git_tags() | hardware_tags()
