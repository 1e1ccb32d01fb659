"""The character-level tokenizer: nanoGPT's shakespeare_char ids, exact round trips."""

import pickle

import pytest

from megatron.data.tokenizers import build_tokenizer
from tests.helpers.paths import load_tool

train_tokenizer = load_tool("train_tokenizer")

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


@pytest.fixture
def char_tok(tmp_path):
    corpus = tmp_path / "input.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    argv = ["--input", str(corpus), "--type", "char-level", "--output-dir", str(tmp_path / "tok")]
    assert train_tokenizer.main(argv) == 0
    return build_tokenizer("CharTokenizer", vocab_file=tmp_path / "tok" / "vocab.json")


def test_every_character_is_a_token_with_nanogpts_ids(char_tok):
    chars = sorted(set(TEXT))  # nanoGPT's data/shakespeare_char/prepare.py
    stoi = {c: i for i, c in enumerate(chars)}
    assert char_tok.tokenize(TEXT) == [stoi[c] for c in TEXT]
    assert (char_tok.eod, char_tok.vocab_size) == (len(chars), len(chars) + 1)


def test_round_trip_keeps_spaces_and_newlines(char_tok):
    for text in (TEXT, "  speak\n\n hear ", "", "\n"):
        assert char_tok.detokenize(char_tok.tokenize(text)) == text
    assert char_tok.tokenize_batch([TEXT, "me"]) == [
        char_tok.tokenize(TEXT),
        char_tok.tokenize("me"),
    ]
    flat, lengths = char_tok.tokenize_batch_arrays([TEXT, "me"])
    assert lengths.tolist() == [len(TEXT), 2] and flat.tolist()[-2:] == char_tok.tokenize("me")
    assert pickle.loads(pickle.dumps(char_tok)).tokenize(TEXT) == char_tok.tokenize(TEXT)


def test_unknown_character_is_named_not_dropped(char_tok):
    with pytest.raises(ValueError, match=r"'Z' \(U\+005A, at offset 3\) is not in --vocab-file"):
        char_tok.tokenize("me Zounds")


def test_a_vocab_that_is_not_characters_names_the_file(tmp_path):
    bad = tmp_path / "vocab.json"
    bad.write_text('{"ab": 0, "<|endoftext|>": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.json: 'ab' is not one character"):
        build_tokenizer("CharTokenizer", vocab_file=bad)
    with pytest.raises(ValueError, match="--vocab-file is required for --tokenizer-type Char"):
        build_tokenizer("CharTokenizer")
