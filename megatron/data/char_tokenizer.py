"""Character-level tokenization, as nanoGPT's shakespeare_char: every character is a token,
spaces and newlines included, so `detokenize(tokenize(text)) == text` for any text drawn from the
vocabulary.

The vocabulary is a JSON object {character: id} (tools/train_tokenizer.py --type char-level
writes one): the corpus's characters sorted by code point, ids 0.. in that order, as nanoGPT's
`sorted(set(data))`, so a corpus gets nanoGPT's ids, then `<|endoftext|>`, the end-of-document
id. A character outside the vocabulary is an error naming it, never a silent `<unk>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from megatron.data.text_pieces import WHITESPACE_CUT
from megatron.data.tokenizers import Tokenizer, _bad_file, _max_id_plus_one, _require_file

CHAR_EOD = "<|endoftext|>"


def char_vocab(texts: Iterable[str]) -> dict[str, int]:
    """{character: id} of every character in `texts`, by code point, then CHAR_EOD."""
    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    vocab = {c: i for i, c in enumerate(sorted(chars))}
    vocab[CHAR_EOD] = len(vocab)
    return vocab


class CharTokenizer(Tokenizer):
    """Every character a token (nanoGPT's shakespeare_char), from a JSON {char: id} vocab."""

    piece_cut = WHITESPACE_CUT  # any cut between characters keeps the ids

    def __init__(self, vocab_file):
        name = "CharTokenizer"
        what = "a JSON {character: id} with <|endoftext|> (train_tokenizer.py --type char-level)"
        path = _require_file(vocab_file, "--vocab-file", name, what)
        try:
            with open(path, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _bad_file("--vocab-file", path, "JSON", err) from err
        if not isinstance(vocab, dict) or CHAR_EOD not in vocab:
            raise ValueError(f"--vocab-file {path}: pass {what}")
        bad = [t for t, i in vocab.items() if not (isinstance(i, int) and i >= 0)]
        bad += [t for t in vocab if len(t) != 1 and t != CHAR_EOD]
        if bad:
            raise ValueError(
                f"--vocab-file {path}: {bad[0]!r} is not one character with an id >= 0; pass {what}"
            )
        super().__init__(name, {"vocab_file": path}, _max_id_plus_one(vocab), vocab[CHAR_EOD])
        self._path, self._vocab = path, vocab
        self._inv = {i: t for t, i in vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        try:
            return [self._vocab[c] for c in text]
        except KeyError as err:
            c = err.args[0]
            raise ValueError(
                f"CharTokenizer: character {c!r} (U+{ord(c):04X}, at offset {text.index(c)}) is "
                f"not in --vocab-file {self._path}; rebuild it from a corpus that has it "
                "(tools/train_tokenizer.py --type char-level)"
            ) from None

    def detokenize(self, ids: Iterable[int]) -> str:
        try:
            return "".join(self._inv[int(i)] for i in ids)
        except KeyError as err:
            raise ValueError(f"CharTokenizer: id {err.args[0]} is not in the vocab") from None
