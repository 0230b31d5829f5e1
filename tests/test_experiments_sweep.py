"""The reference experiments carry their own sweeps (hydra.sweeper.params), compose at
CPU sizes, and every job they sweep plans without refusal."""

from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_module

from pdflow.graph import build_graph
from pdflow.spec.load import compose_spec

SWEEPS = {
    "ref_accuracy": ({"prefill": ["pp4", "tp4"]}, "arith"),
    "ref_prefill_cost": ({"prefill": ["pp4", "tp4"], "drafter": ["dspark", "none"]}, "prefill"),
}


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_experiment_sweeps_its_choices_and_every_job_plans(name):
    want, workload = SWEEPS[name]
    with initialize_config_module(config_module="pdflow.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    params = {k: v.split(",") for k, v in cfg.hydra.sweeper.params.items()}
    assert params == want
    for combo in itertools.product(*params.values()):
        overrides = [f"+experiment={name}", *(f"{k}={v}" for k, v in zip(params, combo, strict=True))]
        spec = compose_spec(overrides)
        assert spec.model.name == "tiny" and spec.workload.kind == workload and spec.workload.num_requests <= 8
        assert build_graph(spec).validate() == [], overrides
