"""The text of a generation as it grows, one token at a time, at a cost per token that does not
grow with the text (as vLLM's incremental detokenizer; this is our own code).

Decoding all the ids at every step costs O(n) per step and O(n^2) per generation, on the
thread that also drives the model. Instead each step decodes a short window of the latest ids:

    ids:   [ ... settled ... | prefix .. read | read .. end ]
                               context          new: their text is text(prefix:end) minus
                                                text(prefix:read), held back while it ends in
                                                U+FFFD (a character whose bytes are split
                                                across tokens), is empty, or may still
                                                change (tokenizer.byte_run_ids)

The context makes the window decode like the full text: a byte-level BPE token or a
SentencePiece piece reads the same wherever it sits, except at the start of a text, where
SentencePiece drops leading spaces; past the first text, windows are decoded by the
tokenizer's `detokenize_window`, which leaves that start handling out. When the new text is
complete, the window moves on: prefix <- read, read <- end. Invariant, checked in
tests/inference/test_detokenizer.py: text + pending == tokenizer.detokenize(ids) after every
step, so the pieces joined equal the full decode.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what detokenize makes of a character whose bytes are split


class IncrementalText:
    """One growing list of ids -> its text: `add(id)` returns the text the id settles (all of
    it final), `pending` is the text of the ids after that (it may still change)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # A tokenizer without detokenize_window has no start handling (a test's fake).
        self._window = getattr(tokenizer, "detokenize_window", tokenizer.detokenize)
        self._byte_runs = getattr(tokenizer, "byte_run_ids", frozenset())
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] are decoded again as the new ids' context
        self.read = 0  # ids before it have settled their text
        self._context = ""  # the text of ids[prefix:read], decoded as the window is
        self.pending = ""

    def _decode(self, ids: list[int]) -> str:
        # Until some text has settled, the window is the start of the text.
        return self.tokenizer.detokenize(ids) if self.prefix == 0 else self._window(ids)

    def add(self, token: int) -> str:
        """The text settled by `token` ("" while it is held back in `pending`)."""
        self.ids.append(token)
        new = self._decode(self.ids[self.prefix :])[len(self._context) :]
        if not new or new.endswith(REPLACEMENT) or token in self._byte_runs:
            self.pending = new
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self._context = self._decode(self.ids[self.prefix : self.read])
        self.pending = ""
        return new
