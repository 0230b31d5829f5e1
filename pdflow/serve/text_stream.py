"""Incremental text of one request, made in the API front from the ids the core sends.

The same rules as the engine's ``Detokenizer`` (which the core switches off): text is
released only when stable, never half a character and never a tail that could still
become a stop string; at the end it is cut where the first stop string begins (the
engine stopped the request there).

Each push decodes a short window (the ids since the last complete character, with the
ones before them as context), not the whole output: decoding everything again per
token made a 128-token stream quadratic, and at 64 streams that was most of a front's
time. The window's text minus its context's text is what the new ids add, exact for
byte-level BPE and for tokenizers that strip a leading space (both windows strip it).
"""

from __future__ import annotations

from pdflow.engine.detokenizer import first_stop, stable_end


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far (complete characters only until the end)
        self.released = 0
        self._context = 0  # ids[_context:_read] are decoded context for the next window
        self._read = 0

    def push(self, token_ids: list[int], *, finished: bool) -> str:
        """The text these ids add (``finished``: everything left, cut at a stop string)."""
        if self.tokenizer is None:
            return ""
        self.ids += token_ids
        self._advance(finished)
        if finished:
            at = first_stop(self.text, self.stop)
            end = len(self.text) if at is None else at
        else:
            end = stable_end(self.text, self.released, self.stop)
        out = self.text[self.released:end]
        self.released = max(self.released, end)
        return out

    def _advance(self, finished: bool) -> None:
        context = self.tokenizer.decode(self.ids[self._context:self._read]) if self._read > self._context else ""
        window = self.tokenizer.decode(self.ids[self._context:])
        if len(window) > len(context) and (finished or not window.endswith("\ufffd")):
            self.text += window[len(context):]
            self._context, self._read = self._read, len(self.ids)
