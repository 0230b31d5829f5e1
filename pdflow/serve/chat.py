"""Chat messages to prompt token ids.

A checkpoint whose tokenizer ships a chat template is rendered with it (as Hugging Face
renders it). One without (pdflow's tiny model) gets ``fallback_prompt``: each message
as ``"<Role>: <content>\\n"`` (roles capitalised, ``developer`` shown as ``System``),
then ``"Assistant:"`` for the model to continue, encoded with the tokenizer's special
tokens (a BOS where it adds one).
"""

from __future__ import annotations

from pdflow.serve.errors import APIError

_ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def fallback_prompt(messages: list[tuple[str, str]]) -> str:
    lines = [f"{_ROLE_NAMES[role]}: {content}\n" for role, content in messages]
    return "".join(lines) + "Assistant:"


def chat_prompt_ids(tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """``messages`` as (role, text) pairs. A template that writes the BOS itself must not
    get a second one from the tokenizer."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot take chat messages; "
                       "use /v1/completions with token ids", param="messages", code="invalid_value")
    if tokenizer.chat_template is None:
        return tokenizer.encode(fallback_prompt(messages))
    try:
        text = tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages]
        )
    except Exception as exc:  # the template itself refuses (raise_exception in jinja)
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages",
                       code="invalid_value") from exc
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
