"""The shipped model's character vocabulary and its `tokenizers` tokenizer.

One token per character keeps the tiny model's arithmetic honest (every digit is seen)
and makes "tokens" and "characters" the same unit for context lengths. The module is
stdlib-only; `tokenizers` is imported inside the functions that build the real thing.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
# Newline plus printable ASCII: every character the task generators can emit.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = 128  # conf/model/tiny.yaml `vocab`; the rest are reserved specials
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(SPECIALS) - len(CHARS)))
NEWLINE_ID = len(SPECIALS)  # CHARS[0] == "\n"


def vocab() -> dict[str, int]:
    """Token -> id, specials first, then characters, then reserved slots up to VOCAB_SIZE."""
    tokens = [*SPECIALS, *CHARS, *RESERVED]
    assert len(tokens) == VOCAB_SIZE
    return {tok: i for i, tok in enumerate(tokens)}


def byte_table() -> bytes:
    """A 256-entry `bytes.translate` table mapping ASCII bytes to ids (others to UNK).

    Ids fit in a byte, so training can encode a whole document with one C call.
    """
    table = bytearray([UNK_ID] * 256)
    for i, ch in enumerate(CHARS):
        table[ord(ch)] = len(SPECIALS) + i
    return bytes(table)


_TABLE = byte_table()
_ID_TO_CHAR = {len(SPECIALS) + i: ch for i, ch in enumerate(CHARS)}


def encode(text: str) -> bytes:
    """Ids of `text` (no BOS) as bytes; non-ASCII characters become UNK."""
    return text.encode("ascii", errors="replace").translate(_TABLE)


def decode(ids) -> str:
    """Characters of `ids`, dropping specials and reserved tokens."""
    return "".join(_ID_TO_CHAR.get(int(i), "") for i in ids)


def build_tokenizer():
    """The `tokenizers.Tokenizer`: WordLevel over single characters, BOS prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens([*SPECIALS, *RESERVED])
    return tok


def save_tokenizer(out_dir: str | Path, *, model_max_length: int = 4096) -> None:
    """Write tokenizer.json and the tokenizer_config.json that `AutoTokenizer` needs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": model_max_length,
        "padding_side": "left",
        # Character tokens: "cleaning up" spaces before punctuation would corrupt text.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
