"""Character-level tokenization, as nanoGPT's shakespeare_char: every character is a token,
spaces and newlines included, so `detokenize(tokenize(text)) == text` for any text drawn from the
vocabulary.

The vocabulary is a JSON object {character: id} (tools/train_tokenizer.py --type char-level
writes one): the corpus's characters sorted by code point, ids 0.. in that order, as nanoGPT's
`sorted(set(data))`, so a corpus gets nanoGPT's ids, then `<|endoftext|>`, the end-of-document
id. A character outside the vocabulary is an error naming it, never a silent `<unk>`.

This module holds the vocabulary's rules (tools/train_tokenizer.py builds one without loading
the tokenizers); the tokenizer itself, `CharTokenizer`, is in megatron.data.tokenizers with the
others.
"""

from __future__ import annotations

from collections.abc import Iterable

CHAR_EOD = "<|endoftext|>"


def char_vocab(texts: Iterable[str]) -> dict[str, int]:
    """{character: id} of every character in `texts`, by code point, then CHAR_EOD."""
    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    vocab = {c: i for i, c in enumerate(sorted(chars))}
    vocab[CHAR_EOD] = len(vocab)
    return vocab
