"""Checkpoint loading (sharded, tied), RoPE scalings, PP layer slices, TP weight slices,
the KV binding's layout, model paths and specs."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.attention.metadata import AttentionMetadata
from pdflow.graph.heads import rank_heads
from pdflow.graph.units import UnitSpec
from pdflow.model.config import DecoderConfig
from pdflow.model.hf_checkpoint import write_random_checkpoint
from pdflow.model.loader import build_model
from pdflow.model.paths import resolve_model_path
from pdflow.model.rope import inverse_frequencies

CPU = torch.device("cpu")


def local_unit_specs(*, layers, num_kv_heads, tp_rank, tp_size, head_dim, dtype, page_tokens,
                     block_size) -> list[UnitSpec]:
    """A rank's target units, as the run graph would place them (for stages built by hand)."""
    heads = rank_heads(num_kv_heads, tp_size, tp_rank)
    return [UnitSpec(family="mha", field=f, layer=layer, heads=heads, head_dim=head_dim,
                     dtype=dtype, page_tokens=page_tokens, block_size=block_size)
            for layer in layers for f in ("k", "v")]


def prefill_logits(model, ids: torch.Tensor, page_tokens: int = 16) -> torch.Tensor:
    """Run one whole-prompt prefill through the paged cache; logits of every position."""
    cfg = model.config
    units = local_unit_specs(
        layers=model.layer_range, num_kv_heads=cfg.num_kv_heads, tp_rank=0, tp_size=1,
        head_dim=cfg.head_dim, dtype="fp32", page_tokens=page_tokens, block_size=32,
    )
    KVCacheBinding(units, 4, CPU).bind(model.attention_layers(), get_backend("torch"))
    n = ids.numel()
    meta = AttentionMetadata(
        decode_only=False, slot_mapping=torch.arange(n) + 32,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
    )
    return model.compute_logits(model(ids, torch.arange(n), meta))


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3", True)])
def test_sharded_checkpoint_loads_to_the_same_logits(tmp_path, family, tied):
    folder = write_random_checkpoint(
        tmp_path, family=family, tie_word_embeddings=tied, max_shard_size="30KB", tokenizer=False
    )
    assert (folder / "model.safetensors.index.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = build_model(DecoderConfig.from_file(folder), folder=folder, dtype=torch.float32,
                       device=CPU)
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(prefill_logits(ours, ids), hf(ids[None]).logits[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_frequencies_match_transformers(scaling):
    cfg = transformers.LlamaConfig(head_dim=32, hidden_size=128, num_attention_heads=4,
                                   rope_theta=5e5, rope_scaling=scaling)
    params = dict(cfg.rope_parameters)
    kind = params.get("rope_type", "default")
    if kind == "default":
        want = 1.0 / (5e5 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        want, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind](cfg, CPU)
    params.pop("rope_theta")
    torch.testing.assert_close(inverse_frequencies(32, 5e5, params), want)


def test_pipeline_stages_chain_to_the_whole_model(tmp_path):
    folder = write_random_checkpoint(tmp_path, family="llama", layers=3, tokenizer=False)
    cfg = DecoderConfig.from_file(folder)
    whole = build_model(cfg, folder=folder, dtype=torch.float32, device=CPU)
    first = build_model(cfg, folder=folder, dtype=torch.float32, device=CPU,
                        layer_range=range(0, 2))
    last = build_model(cfg, folder=folder, dtype=torch.float32, device=CPU,
                       layer_range=range(2, 3))
    assert first.lm_head is None and first.model.norm is None
    assert last.model.embed_tokens is None and sorted(last.model.layers) == ["2"]
    ids = torch.arange(3, 23)
    units = [local_unit_specs(layers=m.layer_range, num_kv_heads=2, tp_rank=0, tp_size=1,
                              head_dim=16, dtype="fp32", page_tokens=16, block_size=32)
             for m in (first, last)]
    assert [u.name for u in units[1]] == ["mha.fp32_d16.k.layer_2", "mha.fp32_d16.v.layer_2"]
    for model, stage_units in zip((first, last), units, strict=True):
        KVCacheBinding(stage_units, 2, CPU).bind(model.attention_layers(), get_backend("torch"))
    meta = AttentionMetadata(
        decode_only=False, slot_mapping=torch.arange(20),
        cu_seqlens_q=torch.tensor([0, 20], dtype=torch.int32),
        context_lens=torch.tensor([20], dtype=torch.int32),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
    )
    hidden = first(ids, torch.arange(20), meta)
    staged = last.compute_logits(last(hidden, torch.arange(20), meta))
    torch.testing.assert_close(staged, prefill_logits(whole, ids))


def test_tensor_parallel_slices_reassemble_the_checkpoint(tmp_path):
    folder = write_random_checkpoint(tmp_path, family="qwen3", tokenizer=False)
    cfg = DecoderConfig.from_file(folder)
    whole = build_model(cfg, folder=folder, dtype=torch.float32, device=CPU)
    ranks = [build_model(cfg, folder=folder, dtype=torch.float32, device=CPU,
                         tp_rank=r, tp_size=2) for r in range(2)]
    name = "model.layers.1.self_attn.qkv_proj.weight"
    q, k, v = whole.state_dict()[name].split([64, 32, 32])
    parts = [m.state_dict()[name].split([32, 16, 16]) for m in ranks]
    for full, piece in zip((q, k, v), zip(*parts, strict=True), strict=True):
        torch.testing.assert_close(torch.cat(piece), full)
    down = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(
        torch.cat([m.state_dict()[down] for m in ranks], dim=1), whole.state_dict()[down]
    )


def test_kv_binding_is_laid_out_as_the_units_say():
    units = local_unit_specs(layers=range(4, 6), num_kv_heads=4, tp_rank=1, tp_size=2,
                             head_dim=8, dtype="bf16", page_tokens=16, block_size=64)
    assert {u.heads for u in units} == {(2, 3)}
    binding = KVCacheBinding(units, num_blocks=3, device=CPU)
    for u in units:
        cache = binding.caches[(u.layer, u.field)]
        assert tuple(cache.shape) == u.cache_shape(3) == (3, 4, 2, 16, 8)
        assert cache.dtype == torch.bfloat16 and cache[0].nbytes == u.bytes_per_block
    replicated = local_unit_specs(layers=range(1), num_kv_heads=2, tp_rank=3, tp_size=4,
                                  head_dim=8, dtype="fp32", page_tokens=8, block_size=8)
    assert replicated[0].heads == (1,)
    undeclared = local_unit_specs(layers=range(1), num_kv_heads=2, tp_rank=0, tp_size=1,
                                  head_dim=8, dtype="fp32", page_tokens=None, block_size=8)
    with pytest.raises(ValueError, match="page_tokens"):
        KVCacheBinding(undeclared, 1, CPU)


def test_model_paths_resolve_inside_the_package_or_on_disk(tmp_path):
    assert resolve_model_path("pdflow:engine") == resolve_model_path(
        str(__import__("pdflow.engine").engine.__path__[0]))
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError):
        resolve_model_path("pdflow:assets/no-such-model")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("no-such-backend")
