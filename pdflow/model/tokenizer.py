"""A checkpoint's ``tokenizers`` tokenizer, its special tokens and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class ChatTokenizer:
    """Encode/decode with the checkpoint's tokenizer.json; render the chat template from
    tokenizer_config.json when it has one (jinja2, as HF renders it)."""

    def __init__(self, folder: Path):
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if self.chat_template is None and template_file.exists():
            self.chat_template = template_file.read_text()
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.tokenizer.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this checkpoint's tokenizer has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


def _token_text(value) -> str | None:
    """tokenizer_config writes special tokens as strings or as {"content": ...} dicts."""
    return value.get("content") if isinstance(value, dict) else value


def _raise(message: str):
    raise ValueError(message)


def load_tokenizer(folder: Path) -> ChatTokenizer | None:
    """None when the checkpoint ships no tokenizer.json (token-id prompts only)."""
    return ChatTokenizer(folder) if (folder / "tokenizer.json").exists() else None
