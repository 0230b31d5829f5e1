"""Incremental text of one request, made in the API front from the ids the core sends.

The same rules as the engine's ``Detokenizer`` (which the core switches off): text is
released only when stable, never half a character and never a tail that could still
become a stop string; at the end it is cut where the first stop string begins (the
engine stopped the request there).
"""

from __future__ import annotations

from pdflow.engine.detokenizer import first_stop, stable_end


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.released = 0

    def push(self, token_ids: list[int], *, finished: bool) -> str:
        """The text these ids add (``finished``: everything left, cut at a stop string)."""
        if self.tokenizer is None:
            return ""
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids)
        if finished:
            at = first_stop(text, self.stop)
            end = len(text) if at is None else at
        else:
            end = stable_end(text, self.released, self.stop)
        out = text[self.released:end]
        self.released = max(self.released, end)
        return out
