"""Incremental text for streaming, and stop-string detection."""

from __future__ import annotations

from pdflow.engine.sequence import Sequence


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
        text = self.tokenizer.decode(seq.output_token_ids)
        hits = [i for i in (text.find(s) for s in seq.sampling.stop) if i >= 0]
        if hits:
            seq.stop_text_at = min(hits)
        return bool(hits)

    def forget(self, request_id: str) -> None:
        self.released.pop(request_id, None)

    def delta(self, seq: Sequence) -> str:
        """Text not yet released for this sequence."""
        if self.tokenizer is None or not self.stream_text:
            return ""
        text = self.text(seq)
        done = self.released.get(seq.request_id, 0)
        end = len(text)
        if not seq.finished:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            hold = max((len(s) for s in seq.sampling.stop), default=1) - 1
            end = max(done, end - hold)
        if seq.finished:
            self.forget(seq.request_id)
        else:
            self.released[seq.request_id] = end
        return text[done:end]
