"""One huge document is tokenized in pieces (issue 30, item 10): the same ids as the whole text,
with memory that follows the piece (a 60 MB JSON line peaked at 7.1 GB; bench/preprocess.py
--huge-doc-mb 60 measures it)."""

import json
import tracemalloc

import numpy as np
import pytest

from megatron.data import text_pieces
from megatron.data.text_pieces import WHITESPACE_CUT, cut_pieces
from megatron.data.tokenizers import build_tokenizer
from tests.helpers.paths import MMAP

FIXTURES = MMAP
CORPUS = [json.loads(line)["text"] for line in open(FIXTURES / "corpus.jsonl", encoding="utf-8")]
TRICKY = [
    "word  two   spaces\n\nnewlines \n indented\tand\ttabs   \n",
    "it's they're we've I'm you'll he'd 's 't",  # GPT-2's contractions, cut nowhere inside
    "a\u00a0nbsp\u3000ideographic\u2028line sep\u0085next\x1c file sep \x1f unit",
    "分布式训练 是 一种 方法。Emoji 🚀🚀 ok 🚀\n  ✓ done",
    "x" * 300 + " " + "1234567890" * 20 + "  ",  # a long word run: the cut moves past it
    "   leading and trailing   ",
    "",
    "\n",
]
TEXTS = CORPUS + TRICKY


def _gpt2(fast: bool):
    tok = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=FIXTURES / "vocab.json",
        merge_file=FIXTURES / "merges.txt",
    )
    if not fast:
        tok._fast = None  # HF tokenizers' path
    return tok


@pytest.mark.parametrize("size", [1, 3, 7, 64])
def test_pieces_rejoin_and_cut_only_between_a_non_space_and_a_space(size):
    for text in TEXTS:
        pieces = list(cut_pieces(text, WHITESPACE_CUT, size))
        assert "".join(pieces) == text
        for left, right in zip(pieces, pieces[1:], strict=False):
            assert len(left) >= size and not left[-1].isspace() and right[0] in " \n"


@pytest.mark.parametrize("engine", ["tiktoken", "hf"])
@pytest.mark.parametrize("size", [1, 5, 32, 200])
def test_pieces_give_the_ids_of_the_whole_text(monkeypatch, engine, size):
    if engine == "tiktoken":
        pytest.importorskip("tiktoken")
    tok = _gpt2(fast=engine == "tiktoken")
    whole = [tok.tokenize(t) for t in TEXTS]  # HF on each whole text: Megatron's ids
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", size)
    flat, lengths = tok.tokenize_batch_arrays(TEXTS)
    assert lengths.tolist() == [len(w) for w in whole]
    assert flat.dtype == np.int64 and flat.tolist() == [i for w in whole for i in w]
    one, _ = tok.tokenize_batch_arrays(["\n".join(TEXTS)])  # one document, many pieces
    assert one.tolist() == tok.tokenize("\n".join(TEXTS))


def test_other_tokenizers_cut_the_same_ids(monkeypatch, tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", ",", "分", "布"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    (tmp_path / "words.json").write_text(json.dumps({"<unk>": 0, "<eod>": 1, "hello": 2}))
    text = "hello  worlds,\n分布 hello\u00a0world \x1c hellos " * 5
    toks = [
        build_tokenizer("BertWordPieceLowerCase", vocab_file=tmp_path / "vocab.txt"),
        build_tokenizer("WhitespaceTokenizer", vocab_file=tmp_path / "words.json"),
    ]
    numbers = " ".join(str(i % 50) for i in range(300)) + "\n7  8"
    null = build_tokenizer("NullTokenizer", vocab_size=50)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 4)
    for tok, t, short in [(toks[0], text, "hello"), (toks[1], text, "hello"), (null, numbers, "3")]:
        flat, lengths = tok.tokenize_batch_arrays([t, short])
        assert flat.tolist() == tok.tokenize(t) + tok.tokenize(short), tok
        assert lengths.tolist() == [len(tok.tokenize(t)), 1]


def test_a_huge_document_is_encoded_in_bounded_memory(monkeypatch):
    """Python-side peak while tokenizing one document, in bytes per id: about 2 int64 copies
    with pieces (the pieces' ids and their concatenation); 6 when tiktoken returned one list of
    Python ints for the whole text (HF's Rust-side Encoding was larger still, unseen here)."""
    pytest.importorskip("tiktoken")
    tok = _gpt2(fast=True)
    tok.tokenize_batch_arrays(["warm up: the first batch is checked against HF"])
    text = "\n".join(CORPUS * 200)  # about 1 MB
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 1 << 14)
    tracemalloc.start()
    try:
        flat, _ = tok.tokenize_batch_arrays([text])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * flat.nbytes, f"peak {peak / flat.nbytes:.1f} x the ids' int64 bytes"
