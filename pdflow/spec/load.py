"""Turn a composed config into typed specs (``__post_init__`` checks run here)."""

from __future__ import annotations

from collections.abc import Sequence

from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

import pdflow.spec.store  # noqa: F401  (registers schemas and resolvers)
from pdflow.spec.run import RunSpec

CONFIG_MODULE = "pdflow.conf"
CONFIG_NAME = "config"


def spec_from_config(cfg: DictConfig) -> RunSpec:
    """Resolve interpolations and build the dataclasses, so per-group checks run."""
    spec = OmegaConf.to_object(cfg)
    if not isinstance(spec, RunSpec):
        raise TypeError(f"composed config is {type(spec).__name__}, expected RunSpec")
    return spec


def compose_spec(overrides: Sequence[str] = ()) -> RunSpec:
    """Compose the packaged config tree with overrides (Hydra's Compose API)."""
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    return spec_from_config(cfg)
