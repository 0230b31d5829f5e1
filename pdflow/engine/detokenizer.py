"""Incremental text for streaming, and stop-string detection."""

from __future__ import annotations

from pdflow.engine.sequence import Sequence


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the first stop string in ``text`` begins, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stable_end(text: str, released: int, stops: list[str]) -> int:
    """How far the text of an unfinished request may be released: never a half-decoded
    character, never the tail that could still become a stop string."""
    end = len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text)
    hold = max((len(s) for s in stops), default=1) - 1
    return max(released, end - hold)


class Detokenizer:
    """Decodes a sequence's output so far. Text is released only when it is stable:
    never a half-decoded character, and never the tail that could still become a
    stop string."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.released: dict[str, int] = {}
        # False where text is made elsewhere (the API front processes decode the ids the
        # engine-core process sends them): ``delta`` is then always "", and costs nothing.
        self.stream_text = True

    def text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(seq.output_token_ids)
        return text if seq.stop_text_at is None else text[: seq.stop_text_at]

    def find_stop(self, seq: Sequence) -> bool:
        """Record where the first stop string begins; True when one is present."""
        if not seq.sampling.stop or self.tokenizer is None:
            return False
        at = first_stop(self.tokenizer.decode(seq.output_token_ids), seq.sampling.stop)
        if at is not None:
            seq.stop_text_at = at
        return at is not None

    def forget(self, request_id: str) -> None:
        self.released.pop(request_id, None)

    def delta(self, seq: Sequence) -> str:
        """Text not yet released for this sequence."""
        if self.tokenizer is None or not self.stream_text:
            return ""
        text = self.text(seq)
        done = self.released.get(seq.request_id, 0)
        end = len(text) if seq.finished else stable_end(text, done, seq.sampling.stop)
        if seq.finished:
            self.forget(seq.request_id)
        else:
            self.released[seq.request_id] = end
        return text[done:end]
