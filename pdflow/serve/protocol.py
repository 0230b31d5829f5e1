"""Request bodies of the OpenAI API, validated strictly (types are not coerced: "5" is
not an int, true is not a number) so a client's mistake is a 400, not a surprise.

Accepted as vLLM accepts them (what evaluation and benchmark clients send):

- ``n`` (1..16): that many choices, each its own engine request; with ``seed``, choice
  ``i`` samples from a generator seeded ``seed + i`` (the same seed gives the same tokens).
  ``best_of`` only equal to ``n`` (or unset).
- ``seed``: the request's own generator, so its samples do not depend on the batch.
- completions ``logprobs`` (0..20): each token's logprob and its top k (the chosen token is
  added to ``top_logprobs`` when outside them); with ``echo``, the prompt's text, tokens and
  logprobs come first (the first prompt token's logprob is null), computed where the prompt
  is prefilled (the prefill instance under P/D; a prompt asking for them is not served
  from the prefix cache). ``echo`` alone prepends the prompt's text.
- chat ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs ``logprobs``).
- ``stream_options.include_usage``: a last chunk with ``usage`` (and ``usage: null`` on
  the others). Every usage says ``prompt_tokens_details.cached_tokens``: the prompt tokens
  served from the prefix cache (under P/D, the decode side's: tokens whose KV did not move).

- ``return_token_ids``: each choice also carries ``token_ids`` (its output ids; streamed,
  the chunk's) and ``prompt_token_ids`` (streamed: in the choice's first chunk).

Refused (400): penalties, ``logit_bias``, ``suffix``, tools. pdflow extensions, as vLLM
names them: ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

MAX_STOPS = 4
MAX_N = 16
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def _documented(schema: dict) -> WithJsonSchema:
    """The OpenAPI schema of a field its validator narrows: what is accepted, so clients
    (and schemathesis) see the real contract instead of ``any``."""
    return WithJsonSchema(schema)


_NULL = {"type": "null"}
_STOP = _documented({"anyOf": [{"type": "string", "minLength": 1},
                               {"type": "array", "items": {"type": "string", "minLength": 1},
                                "maxItems": MAX_STOPS}, _NULL]})
_ZERO = _documented({"anyOf": [{"const": 0}, _NULL]})
_NONE_OR_EMPTY = _documented({"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]})
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT = _documented({"anyOf": [{"type": "string"}, _TOKEN_IDS]})
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT = _documented({"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences are supported, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty")
    return stops


def _only(value: Any, allowed: tuple, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"{what}")
    return value


class SamplingFields(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Annotated[Any, _STOP] = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float | None, _ZERO] = None
    frequency_penalty: Annotated[float | None, _ZERO] = None
    logit_bias: Annotated[dict[str, float] | None, _NONE_OR_EMPTY] = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # vLLM's: each choice also carries its token ids (streamed: the chunk's, and the
    # prompt's in the choice's first chunk), so a client can extend a conversation by the
    # exact tokens it was answered with rather than re-tokenizing the text.
    return_token_ids: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        return _stops(v)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        return _only(v, (None, 0, 0.0), "penalties are not supported (leave them at 0)")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        return _only(v, (None, {}), "logit_bias is not supported")

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, _PROMPT]
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: Annotated[str | None, _documented(_NULL)] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        """A string or token ids; a batch only when it holds exactly one of those."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            raise ValueError("only one prompt per request is supported")
        raise ValueError("prompt must be a string or a non-empty list of token ids")

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, v, info: ValidationInfo):
        if v is not None and v != (info.data.get("n") or 1):
            raise ValueError("best_of is supported only equal to n")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _only(v, (None,), "suffix is not supported")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    # A string, or text parts ({"type": "text", "text": ...}), joined into one string.
    content: Annotated[Any, _CONTENT]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_content(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in v
        ):
            return "".join(p["text"] for p in v)
        raise ValueError('content must be a string or a list of {"type": "text", "text": ...} parts')


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: Annotated[dict | None, _documented({"anyOf": [
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"const": "text"}}}, _NULL]})] = None
    tools: Annotated[list | None, _documented({"anyOf": [{"type": "array", "maxItems": 0}, _NULL]})] = None
    tool_choice: Annotated[Any, _documented({"anyOf": [{"const": "none"}, _NULL]})] = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        return _only(v, (None, {"type": "text"}), "only response_format {\"type\": \"text\"} is supported")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        return _only(v, (None, []), "tools are not supported")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        return _only(v, (None, "none"), "tool_choice is not supported")

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
