"""``model.path`` and the checkpoint's config.json: ``model=hf`` takes the geometry from it,
and a declared geometry that disagrees with it is refused at plan time, by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdflow.graph import Code, build_graph
from pdflow.spec.load import compose_spec

GEOMETRY = dict(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                vocab=300)


@pytest.fixture
def qwen3_ckpt(tmp_path):
    """A HF-style checkpoint folder holding only config.json (written by transformers)."""
    from transformers import Qwen3Config

    folder = tmp_path / "little-qwen3"
    Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, dtype="bfloat16").save_pretrained(folder)
    return folder


def test_model_hf_reads_the_geometry_from_the_checkpoint(qwen3_ckpt):
    spec = compose_spec(["model=hf", f"model.path={qwen3_ckpt}"])
    m = spec.model
    assert {k: getattr(m, k) for k in GEOMETRY} == GEOMETRY
    assert (m.architecture, m.dtype, m.max_model_len, m.name) == \
        ("Qwen3ForCausalLM", "bf16", 1024, "little-qwen3")
    graph = build_graph(spec)
    assert graph.validate() == []
    # The head cut follows the checkpoint's 2 KV heads: decode tp4 replicates them.
    assert graph.consumer is not None


def test_declared_values_stay_and_a_mismatch_is_refused_by_name(qwen3_ckpt):
    spec = compose_spec(["model=hf", f"model.path={qwen3_ckpt}", "model.kv_heads=4",
                         "model.max_model_len=512"])
    assert spec.model.max_model_len == 512  # a shorter context is a choice, not a mismatch
    graph = build_graph(spec)
    assert graph.codes() == {Code.MODEL_GEOMETRY_MISMATCH}
    (refusal,) = graph.validate()
    assert "model.kv_heads=4" in refusal.message and "kv_heads 2" in refusal.message
    assert str(qwen3_ckpt) in refusal.message
    assert refusal.fix.startswith("set model.kv_heads=2") and "model=hf" in refusal.fix


def test_a_declared_model_pointed_at_another_checkpoint_is_refused(qwen3_ckpt):
    graph = build_graph(compose_spec([f"model.path={qwen3_ckpt}"]))  # tiny's geometry
    wrong = {r.message.split("=")[0] for r in graph.validate()
             if r.code is Code.MODEL_GEOMETRY_MISMATCH}
    assert wrong == {"model.architecture", "model.layers", "model.hidden", "model.heads",
                     "model.kv_heads", "model.head_dim", "model.intermediate", "model.vocab"}


def test_model_hf_without_a_path_says_what_to_give():
    with pytest.raises(ValueError, match=r"model.path=<HF checkpoint folder \(with config.json\) or hub id>"):
        compose_spec(["model=hf"])


def test_an_unreadable_path_is_not_checked_at_plan_time(tmp_path):
    # Plans may be made on a machine without the checkpoint.
    graph = build_graph(compose_spec([f"model.path={tmp_path / 'elsewhere'}"]))
    assert Code.MODEL_GEOMETRY_MISMATCH not in graph.codes()


def test_the_loader_compares_the_same_fields(qwen3_ckpt):
    from pdflow.model.config import DecoderConfig

    spec = compose_spec(["model=hf", f"model.path={qwen3_ckpt}"]).model
    cfg = DecoderConfig.from_file(qwen3_ckpt)
    cfg.check_matches(spec)
    wrong = compose_spec(["model=hf", f"model.path={qwen3_ckpt}", "model.head_dim=32"]).model
    with pytest.raises(ValueError, match="head_dim: spec 32 vs checkpoint 16"):
        cfg.check_matches(wrong)


def _plan(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "pdflow.cli", "plan", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_cli_plan_with_model_path(qwen3_ckpt, tmp_path):
    ok = _plan(tmp_path, "model=hf", f"model.path={qwen3_ckpt}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "model little-qwen3 (4 layers, 2 KV heads, d16)" in ok.stdout
    refused = _plan(tmp_path, f"model.path={qwen3_ckpt}")
    assert refused.returncode != 0
    out = refused.stdout + refused.stderr
    assert "MODEL_GEOMETRY_MISMATCH" in out and "model=hf model.path=" in out
