"""The graph's weight budget for MoE models: every expert of every sparse layer on every
TP rank (a 1/tp slice of each: no expert parallelism), dense layers where the checkpoint
keeps them; the geometry read from a Qwen3-MoE config.json and checked like the dense one."""

from __future__ import annotations

import json

from pdflow.graph import CONSUMER, Code

# Qwen3-30B-A3B by hand (conf/model/qwen3-30b-a3b.yaml): attention 2048 x 128 x (2x32 + 2x4),
# two norms, the router 128 x 2048, 128 experts of 3 x 2048 x 768.
ATTENTION = 2048 * 128 * (2 * 32 + 2 * 4) + 2 * 2048
SPARSE = ATTENTION + 128 * 2048 + 128 * 3 * 2048 * 768
DENSE = ATTENTION + 3 * 2048 * 6144
EMBED = 151936 * 2048
A3B = ["model=qwen3-30b-a3b", "mode=monolithic", "drafter=none"]


def _weights(graph) -> list[int]:
    return [s.weight_bytes for s in graph.budgets[CONSUMER].stages]


def test_every_expert_is_counted_per_rank(graph_of):
    total = 48 * SPARSE + 2 * EMBED
    assert 30.4e9 < total < 30.6e9  # Qwen3-30B-A3B's 30.5B parameters
    assert _weights(graph_of(*A3B, "decode=tp1")) == [total * 2]  # bf16
    assert _weights(graph_of(*A3B, "decode=tp4")) == [total * 2 // 4]
    assert _weights(graph_of(*A3B, "decode=tp1", "decode.pp=2")) == [
        (24 * SPARSE + EMBED) * 2, (24 * SPARSE + EMBED) * 2]


def test_dense_layers_of_an_moe_model_count_as_dense(graph_of):
    sparse_step = graph_of(*A3B, "decode=tp1", "decode.pp=2", "model.sparse_step=2")
    listed = graph_of(*A3B, "decode=tp1", "decode.pp=2", "model.mlp_only_layers=[1,3,5,7,9]")
    assert _weights(sparse_step) == [(12 * SPARSE + 12 * DENSE + EMBED) * 2] * 2
    assert _weights(listed) == [(19 * SPARSE + 5 * DENSE + EMBED) * 2, (24 * SPARSE + EMBED) * 2]


def _qwen3_moe_config(folder, **changes):
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 96, "vocab_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "mlp_only_layers": [1], "decoder_sparse_step": 1,
           "max_position_embeddings": 1024, "torch_dtype": "float32", **changes}
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_model_hf_reads_the_moe_geometry(graph_of, tmp_path):
    folder = _qwen3_moe_config(tmp_path / "released")
    # transformers 5 writes num_local_experts where released checkpoints say num_experts
    renamed = _qwen3_moe_config(tmp_path / "saved", num_experts=None, num_local_experts=8)
    for path in (folder, renamed):
        graph = graph_of("model=hf", f"model.path={path}", *A3B[1:], "decode=tp2")
        m = graph.spec.model
        assert (m.experts, m.experts_per_token, m.moe_intermediate, list(m.mlp_only_layers)) == (8, 2, 32, [1])
        assert graph.validate() == []


def test_a_declared_expert_count_that_disagrees_is_refused(graph_of, tmp_path):
    folder = _qwen3_moe_config(tmp_path / "ck")
    graph = graph_of("model=hf", f"model.path={folder}", "model.experts=16", *A3B[1:], "decode=tp2")
    assert graph.codes() == {Code.MODEL_GEOMETRY_MISMATCH}
    assert "model.experts=16" in graph.validate()[0].message
