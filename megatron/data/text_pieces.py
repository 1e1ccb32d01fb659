"""Tokenizing a huge document in pieces, so memory follows the piece and not the document.

Tokenizers build per-token Python objects (tiktoken a list of ints, HF tokenizers an Encoding
with strings and offsets per token): a 60 MB JSON line peaked at 7.1 GB. A text longer than
PIECE_CHARS is therefore cut into pieces of about that size and encoded a few pieces per call.

Where a cut is safe, for GPT-2's byte-level BPE: between a non-whitespace character and a
following space or newline. Every alternative of GPT-2's pre-tokenizer regex
(`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`) that can hold
a non-whitespace character holds nothing but non-whitespace after its optional leading space,
so the pre-token holding the character before the cut ends there, and the regex has no
look-behind, so matching after the cut does not depend on what came before. BPE merges within
a pre-token only: the ids of the pieces, concatenated, are the ids of the whole. Python's `\\S`
excludes every Unicode White_Space character (and more: U+001C..U+001F), so a cut found here is
also one in the regex engines' sense. BERT's and whitespace splitting drop whitespace between
words, so the same cuts are safe for them. (A tokenizer with a prefix added to the first piece
only, e.g. SentencePiece's dummy prefix, has no such cut: it sets none and encodes whole.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

PIECE_CHARS = 1 << 18  # a longer text is cut into pieces of about this many characters
PIECES_PER_CALL = 4  # pieces given to the encoder at once (HF encodes a batch on all cores)
WHITESPACE_CUT = re.compile(r"\S(?=[ \n])")  # the cut is at the match's end

Encode = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]


def cut_pieces(text: str, cut: re.Pattern, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at least `size` characters (the last may be shorter),
    each ending at a match of `cut`; a stretch with no such place stays in one piece."""
    start = 0
    while len(text) - start > size:
        m = cut.search(text, start + size - 1)
        if m is None:
            break
        yield text[start : m.end()]
        start = m.end()
    yield text[start:]


def _encode_long(encode: Encode, text: str, cut: re.Pattern, size: int) -> np.ndarray:
    parts, batch = [], []
    for piece in cut_pieces(text, cut, size):
        batch.append(piece)
        if len(batch) == PIECES_PER_CALL:
            parts.append(encode(batch)[0])
            batch = []
    if batch:
        parts.append(encode(batch)[0])
    return np.concatenate(parts)


def encode_in_pieces(
    encode: Encode, texts: list[str], cut: re.Pattern | None, size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`encode(texts)` -> (all ids, the number of ids of each text), with every text longer than
    `size` (PIECE_CHARS) encoded piece by piece; the same ids. `cut` None: all texts whole."""
    size = size or PIECE_CHARS
    long = [cut is not None and len(t) > size for t in texts]
    if not any(long):
        return encode(texts)
    short = [t for t, is_long in zip(texts, long, strict=True) if not is_long]
    if short:
        flat, lengths = encode(short)
        short_ids = iter(np.split(flat, np.cumsum(lengths)[:-1]))  # views, no copy
    per_text = [
        _encode_long(encode, t, cut, size) if is_long else next(short_ids)
        for t, is_long in zip(texts, long, strict=True)
    ]
    lengths = np.fromiter((len(ids) for ids in per_text), dtype=np.int64, count=len(per_text))
    if len(per_text) == 1:  # one huge document: its ids are already one array
        return per_text[0], lengths
    return np.concatenate(per_text).astype(np.int64, copy=False), lengths
