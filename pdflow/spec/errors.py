"""Config errors as one line naming the key (``decode.block_size``) and what is allowed.

Why: a spec check raised inside ``OmegaConf.to_object`` does not know which group it
fills (``prefill`` and ``decode`` share ParallelSpec), Hydra wraps composition errors in
several lines (and suggests ``+key=value``, which then fails on the dataclass), and an
unknown key reaches the dataclass as a raw AttributeError.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from pdflow.spec.run import RunSpec

SCHEMA_SUFFIX = "_schema"


class ConfigError(ValueError):
    """A config pdflow cannot build: the message is one line naming the key."""


def _fields(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(kind)]


def unknown_key_error(key: str, root: type = RunSpec) -> ConfigError:
    """``key`` (dotted) is not a field of the dataclass its parent is built into."""
    parent, _, _ = key.rpartition(".")
    kind = root
    for part in parent.split(".") if parent else []:
        kind = typing.get_type_hints(kind).get(part) if dataclasses.is_dataclass(kind) else None
    where = f"of {parent}" if parent else "at the top level"
    allowed = f"; settings {where}: {', '.join(_fields(kind))}" if dataclasses.is_dataclass(kind) else ""
    return ConfigError(f"{key} is not a pdflow setting{allowed}")


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys in ``node`` that its dataclass has no field for (``+foo=1`` adds them)."""
    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return []
    names = set(_fields(kind))
    found = []
    for key, value in node.items_ex(resolve=False):
        if key not in names:
            found.append(f"{prefix}{key}")
        elif isinstance(value, DictConfig):
            found += unknown_keys(value, f"{prefix}{key}.")
    return found


def name_keys(message: str, group: str, kind: type) -> str:
    """Prefix the bare field names of ``kind`` in ``message`` with ``group.`` (the side),
    unless the message already names its keys."""
    if f"{group}." in message:
        return message
    pattern = r"(?<![\w.])(" + "|".join(map(re.escape, _fields(kind))) + r")(?!\w)"
    named = re.sub(pattern, rf"{group}.\1", message)
    return named if named != message else f"{group}: {message}"


def locate(cfg: DictConfig, err: Exception) -> ConfigError:
    """The group whose own spec check fails, its keys named with that group."""
    for group, node in cfg.items_ex(resolve=False):
        if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(OmegaConf.get_type(node)):
            continue
        try:
            OmegaConf.to_object(node)
        except (ValueError, OmegaConfBaseException) as group_err:
            return ConfigError(name_keys(_first_line(group_err), group, OmegaConf.get_type(node)))
    return ConfigError(_first_line(err))


def _first_line(err: BaseException) -> str:
    if isinstance(err, OmegaConfBaseException) and err.msg:
        return str(err.msg).splitlines()[0]
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def describe(err: BaseException) -> str | None:
    """One line for a config error raised while composing or building specs; None when
    ``err`` is not a config error (a bug, which keeps its traceback)."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, MissingConfigException):
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if not group:
            return _first_line(err)
        return unknown_choice(group, option, err.options or [])
    if isinstance(err, OverrideParseException):
        return f"cannot parse override {err.override!r}: {err.message.splitlines()[0]}"
    if isinstance(err, HydraException):
        cause = err.__cause__
        if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
            return str(unknown_key_error(cause.full_key))
        if isinstance(cause, OmegaConfBaseException):
            return f"{cause.full_key}: {_first_line(cause)}" if cause.full_key else _first_line(cause)
        return " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, MissingMandatoryValue):
        return f"{err.full_key} has no value; choose one ({err.full_key}=<option>)"
    if isinstance(err, OmegaConfBaseException):
        return f"{err.full_key}: {_first_line(err)}" if err.full_key else _first_line(err)
    return None


def unknown_choice(group: str, option: str, options: list[str]) -> str:
    choices = [o for o in options if not o.endswith(SCHEMA_SUFFIX)]
    return f"{group}={option} is not a {group} option; choices: {', '.join(choices)}"
