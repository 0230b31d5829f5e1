"""Every option of every group, and every experiment, composes into typed specs."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from pdflow.spec import RunSpec
from pdflow.spec.load import compose_spec
from pdflow.spec.store import GROUP_SCHEMAS

CONF = resources.files("pdflow.conf")


def options(group: str) -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in CONF.joinpath(group).iterdir() if p.name.endswith(".yaml"))


GROUP_OPTIONS = [(g, o) for g in GROUP_SCHEMAS for o in options(g)]
# Options that need a value to compose: model=hf reads its geometry from model.path.
NEEDS = {("model", "hf"): ["model.path=pdflow:assets/tiny"]}


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_group_option_composes(group, option):
    spec = compose_spec([f"{group}={option}", *NEEDS.get((group, option), [])])
    assert isinstance(spec, RunSpec)
    schema = GROUP_SCHEMAS[group][1]
    assert isinstance(getattr(spec, group), schema)
    # Each option names its schema in its defaults list.
    text = yaml.safe_load(CONF.joinpath(group, f"{option}.yaml").read_text())
    assert GROUP_SCHEMAS[group][0] in text["defaults"]


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_composes_and_is_allowed(graph_of, experiment):
    graph = graph_of(f"+experiment={experiment}")
    assert graph.spec.name == experiment
    assert graph.validate() == []


def test_every_group_has_options():
    for group in GROUP_SCHEMAS:
        assert options(group), group
    assert {"tp1", "tp2", "tp4", "pp2", "pp4", "pp4-uneven"} <= set(options("prefill"))
    assert {"none", "dspark", "eagle", "eagle3"} <= set(options("drafter"))
    assert {"tiny", "minimax-m3", "llama3-8b", "qwen3-0.6b", "qwen3-8b"} <= set(options("model"))


def test_default_is_pd_with_pp_prefill_tp_decode_and_a_drafter():
    spec = compose_spec([])
    assert spec.model.name == "tiny"
    assert spec.prefill.pp > 1 and spec.decode.tp > 1 and spec.drafter.kind == "dspark"


def test_bad_group_value_is_rejected_at_compose_time():
    with pytest.raises(Exception, match="drafter.kind"):
        compose_spec(["drafter.kind=medusa"])
