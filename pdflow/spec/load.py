"""Turn a composed config into typed specs (``__post_init__`` checks run here)."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

import pdflow.spec.store  # noqa: F401  (registers schemas and resolvers)
from pdflow.spec.errors import ConfigError, describe, locate, unknown_key_error, unknown_keys
from pdflow.spec.run import RunSpec

CONFIG_MODULE = "pdflow.conf"
CONFIG_NAME = "config"


def spec_from_config(cfg: DictConfig) -> RunSpec:
    """Resolve interpolations and build the dataclasses, so per-group checks run; a value
    they refuse raises ConfigError naming its key (``decode.block_size``)."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise unknown_key_error(unknown[0])
    try:
        spec = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        raise ConfigError(describe(err)) from err
    except (ValueError, OmegaConfBaseException) as err:
        raise locate(cfg, err) from err
    if not isinstance(spec, RunSpec):
        raise TypeError(f"composed config is {type(spec).__name__}, expected RunSpec")
    return spec


def compose_spec(overrides: Sequence[str] = ()) -> RunSpec:
    """Compose the packaged config tree with overrides (Hydra's Compose API)."""
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    return spec_from_config(cfg)


def group_choices() -> dict[str, list[str]]:
    """Each config group's options, as the packaged tree ships them (conf/<group>/*.yaml;
    the ``*_schema`` entries Hydra also lists are internal, not choices)."""
    root = resources.files(CONFIG_MODULE)
    groups = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith("_")),
                    key=lambda d: d.name)
    return {d.name: sorted(f.name[:-5] for f in d.iterdir() if f.name.endswith(".yaml")) for d in groups}


def default_choices() -> dict[str, str]:
    """The option each group takes when none is given (config.yaml's defaults list)."""
    tree = OmegaConf.create(resources.files(CONFIG_MODULE).joinpath(f"{CONFIG_NAME}.yaml").read_text())
    return {k: v for entry in tree.defaults if isinstance(entry, DictConfig)
            for k, v in entry.items() if "/" not in str(k) and not str(k).startswith("override")}
