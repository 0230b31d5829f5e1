"""Registers every group's schema in Hydra's ConfigStore, and pdflow's resolvers."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pdflow.spec.checkpoint import checkpoint_field
from pdflow.spec.drafter import DrafterSpec
from pdflow.spec.model import ModelSpec
from pdflow.spec.parallel import ParallelSpec
from pdflow.spec.run import RunSpec, TrackingSpec, WorkloadSpec
from pdflow.spec.transfer import TransferSpec

GROUP_SCHEMAS = {
    "model": ("model_schema", ModelSpec),
    "prefill": ("parallel_schema", ParallelSpec),
    "decode": ("parallel_schema", ParallelSpec),
    "drafter": ("drafter_schema", DrafterSpec),
    "transfer": ("transfer_schema", TransferSpec),
    "workload": ("workload_schema", WorkloadSpec),
    "tracking": ("tracking_schema", TrackingSpec),
}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunSpec)
    for group, (name, schema) in GROUP_SCHEMAS.items():
        cs.store(group=group, name=name, node=schema)
    if not OmegaConf.has_resolver("pdflow.range"):
        OmegaConf.register_new_resolver("pdflow.range", lambda a, b: list(range(int(a), int(b))))
    if not OmegaConf.has_resolver("pdflow.checkpoint"):
        OmegaConf.register_new_resolver("pdflow.checkpoint", checkpoint_field)


register()
