"""Write small random HF checkpoints with ``transformers`` (a test extra): the oracle's
own files, for tests and the engine benchmark."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``w0 .. w{V-4}`` plus <unk>, <s>, </s>, with a chat
    template in tokenizer_config.json, so the loader's tokenizer path is exercised."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(vocab_size - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }))


def write_random_checkpoint(
    folder: Path, *, family: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4,
    kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128, vocab: int = 200,
    seed: int = 0, init_std: float = 0.02, tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None, max_shard_size: str | None = None, tokenizer: bool = True,
    moe: dict | None = None,
) -> Path:
    """A randomly initialised Llama, Qwen3 or Qwen3-MoE saved with ``save_pretrained``
    (fp32). ``moe``: Qwen3MoeConfig fields (num_experts, num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob, mlp_only_layers, decoder_sparse_step)."""
    import torch
    import transformers

    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=vocab, initializer_range=init_std, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, max_position_embeddings=1024,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_scaling=rope_scaling)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, rope_scaling=rope_scaling)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, rope_scaling=rope_scaling, **(moe or {}))
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"family {family!r}: llama, qwen3 or qwen3_moe")
    torch.manual_seed(seed)
    model = cls(cfg).float()
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    if tokenizer:
        write_word_tokenizer(folder, vocab)
    return folder
