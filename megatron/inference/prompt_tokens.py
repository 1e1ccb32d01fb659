"""A request's text as ids, with the work and memory bounded by the model's context.

A prompt longer than the context is refused, never truncated, so all it needs is "more than
`limit` ids": tokenizing all of it first cost 39 s and 5 GB on rank 0 for four 8 MB prompts
(tokenizers build Python objects per token). Two bounds stop early instead:

    characters   where the tokenizer says how much text one id can stand for at most
                 (`max_token_chars`: the longest token's bytes for byte-level BPE, as a text
                 character is at least one byte), a text of more than limit * that many
                 characters has more than `limit` ids: refused before any tokenizing
    pieces       the text is tokenized in pieces cut where the ids can not change
                 (text_pieces.cut_pieces at the tokenizer's `piece_cut`), and the count stops
                 at the first piece past `limit`; the ids of a text that fits are those of the
                 whole text

A tokenizer with neither (SentencePiece, a tokenizer.json) tokenizes the text whole, once.
"""

from __future__ import annotations

from megatron.data.text_pieces import cut_pieces

PIECE_CHARS = 1 << 13  # characters tokenized per call when counting toward the limit


def past_char_bound(tokenizer, chars: int, limit: int) -> bool:
    """`chars` characters surely make more than `limit` ids: the tokenizer bounds the
    characters one id stands for (byte-level BPE: its longest token's bytes)."""
    most = getattr(tokenizer, "max_token_chars", None)
    return most is not None and chars > limit * most


def tokenize_within(tokenizer, text: str, limit: int) -> list[int] | None:
    """The ids of `text`, or None when it has more than `limit` of them (found without
    tokenizing more than about one piece past the limit)."""
    if past_char_bound(tokenizer, len(text), limit):
        return None
    cut = getattr(tokenizer, "piece_cut", None)
    if cut is None:
        ids = tokenizer.tokenize(text)
        return ids if len(ids) <= limit else None
    ids: list[int] = []
    for piece in cut_pieces(text, cut, PIECE_CHARS):
        ids += tokenizer.tokenize(piece)
        if len(ids) > limit:
            return None
    return ids


def too_long(what: str, limit: int, why: str) -> str:
    """The message of a refused text: what it was, the limit and where the limit comes from."""
    return (
        f"{what} is longer than {limit} tokens ({why}); it was refused without being "
        "tokenized in full: shorten it"
    )
