"""Drafter checkpoints: HF-style files, exact round trip, TP slices, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from specdec_helpers import small_drafter, small_graph, small_target

from pdflow.spec_decode import DrafterConfig, DraftPlacementMismatch, load_drafter, save_drafter


@pytest.fixture(scope="module", params=["dspark", "eagle3"])
def saved(request, tmp_path_factory):
    graph = small_graph(request.param)
    cfg, target = small_target(graph)
    drafter, _ = small_drafter(graph, cfg, target)
    folder = save_drafter(drafter, tmp_path_factory.mktemp(request.param))
    return graph, drafter, folder


def test_files_are_hf_shaped(saved):
    _, drafter, folder = saved
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "pdflow_drafter" and raw["drafter_kind"] == drafter.kind
    assert raw["tap_layers"] == list(drafter.tap_layers)
    assert DrafterConfig.from_hf_dict(raw).tap_layers == drafter.config.tap_layers
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"} <= names
    assert not any("qkv_proj" in n or "gate_up" in n for n in names)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # shared with the target


def test_round_trip_is_exact(saved):
    graph, drafter, folder = saved
    loaded = load_drafter(folder, graph.rank("decode", 0).units)
    want = drafter.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_tp_slices_reassemble_the_checkpoint(saved, tmp_path):
    graph, drafter, folder = saved
    tp2 = small_graph(drafter.kind, tp=2)
    ranks = [load_drafter(folder, tp2.rank("decode", r).units, tp_rank=r, tp_size=2) for r in range(2)]
    cfg, d = drafter.config, drafter.config.head_dim
    full = drafter.layers[0].self_attn.qkv_proj.weight.split([cfg.num_heads * d, cfg.num_kv_heads * d,
                                                            cfg.num_kv_heads * d])
    parts = [r.layers[0].self_attn.qkv_proj.weight.split([cfg.num_heads * d // 2, cfg.num_kv_heads * d // 2,
                                                          cfg.num_kv_heads * d // 2]) for r in ranks]
    for whole, pieces in zip(full, zip(*parts, strict=True), strict=True):
        assert torch.equal(torch.cat(pieces), whole)
    down = [r.layers[0].mlp.down_proj.weight for r in ranks]
    assert torch.equal(torch.cat(down, dim=1), drafter.layers[0].mlp.down_proj.weight)
    assert torch.equal(ranks[1].fc.weight, drafter.fc.weight)  # replicated


def test_broken_checkpoints_are_refused(saved, tmp_path):
    graph, drafter, folder = saved
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    missing = dict(tensors)
    missing.pop("norm.weight")
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="left parameters unset"):
        load_drafter(tmp_path, graph.rank("decode", 0).units)
    save_file({**tensors, "extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="extra.weight"):
        load_drafter(tmp_path, graph.rank("decode", 0).units)
    other = small_graph(drafter.kind, extra=("drafter.layers=3",) if drafter.kind == "dspark" else
                        ("drafter.head_dim=8",))
    with pytest.raises(DraftPlacementMismatch):
        load_drafter(folder, other.rank("decode", 0).units)
