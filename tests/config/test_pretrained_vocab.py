"""--tokenizer-model-type NAME resolves to a vocab in --cache-dir or --vocab-file; nothing is
downloaded, and a missing file fails naming what to pass."""

import shutil
from pathlib import Path

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import main as preprocess_main
from tests.helpers.paths import MMAP

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def _cache(tmp_path, layout):
    """A cache dir holding the fixture GPT-2 vocab under one of the looked-for layouts."""
    names = {
        "urls": ("gpt2-vocab.json", "gpt2-merges.txt"),
        "folder": ("gpt2/vocab.json", "gpt2/merges.txt"),
        "hub": ("models--gpt2/snapshots/abc/vocab.json", "models--gpt2/snapshots/abc/merges.txt"),
    }[layout]
    for src, dst in zip(("vocab.json", "merges.txt"), names, strict=True):
        (tmp_path / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(MMAP / src, tmp_path / dst)
    return tmp_path


@pytest.mark.parametrize("layout", ["urls", "folder", "hub"])
def test_gpt2_resolves_from_the_cache_dir(tmp_path, layout):
    cache = _cache(tmp_path, layout)
    cfg = parse_args([*BASE, "--tokenizer-model-type", "gpt2", "--cache-dir", str(cache)], 1)
    tok = cfg.data.tokenizer
    assert tok.tokenizer_type == "GPT2BPETokenizer"
    assert Path(tok.vocab_file).read_bytes() == (MMAP / "vocab.json").read_bytes()
    assert Path(tok.merge_file).read_bytes() == (MMAP / "merges.txt").read_bytes()


def test_bert_uses_the_given_vocab_file_and_the_right_tokenizer(tmp_path):
    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n")
    argv = [
        *BASE,
        "--tokenizer-model-type",
        "bert-large-cased",
        "--vocab-file",
        str(tmp_path / "v.txt"),
    ]
    tok = parse_args(argv, 1).data.tokenizer
    assert tok.tokenizer_type == "BertWordPieceCase" and tok.vocab_file == str(tmp_path / "v.txt")
    shutil.copy(tmp_path / "v.txt", tmp_path / "bert-large-uncased-vocab.txt")
    argv = [*BASE, "--tokenizer-model-type", "bert-large-uncased", "--cache-dir", str(tmp_path)]
    tok = parse_args(argv, 1).data.tokenizer
    assert tok.tokenizer_type == "BertWordPieceLowerCase"
    assert tok.vocab_file == str(tmp_path / "bert-large-uncased-vocab.txt")


def test_missing_vocab_or_conflicting_type_fails_naming_what_to_pass(tmp_path, capsys):
    with pytest.raises(
        ConfigError,
        match="no --cache-dir given.*Fix: pass --cache-dir DIR holding "
        "bert-large-uncased-vocab.txt.*--vocab-file PATH",
    ):
        parse_args([*BASE, "--tokenizer-model-type", "bert-large-uncased"], 1)
    with pytest.raises(ConfigError, match=f"looked for {tmp_path}/gpt2-merges.txt"):
        shutil.copy(MMAP / "vocab.json", tmp_path / "gpt2-vocab.json")
        parse_args([*BASE, "--tokenizer-model-type", "gpt2", "--cache-dir", str(tmp_path)], 1)
    with pytest.raises(
        ConfigError,
        match="gpt2 is a GPT2BPETokenizer vocab, but --tokenizer-type BertWordPieceCase",
    ):
        parse_args(
            [*BASE, "--tokenizer-model-type", "gpt2", "--tokenizer-type", "BertWordPieceCase"], 1
        )
    argv = ["--input", str(MMAP / "corpus.jsonl"), "--output-prefix", str(tmp_path / "o")]
    assert preprocess_main([*argv, "--tokenizer-model-type", "gpt2"]) == 2
    assert "--tokenizer-model-type: gpt2: its vocab.json was not found" in capsys.readouterr().err


def test_preprocess_with_the_model_type_writes_megatrons_bytes(tmp_path):
    cache = _cache(tmp_path / "cache", "urls")
    argv = ["--input", str(MMAP / "corpus.jsonl"), "--output-prefix", str(tmp_path / "o")]
    assert (
        preprocess_main(
            [*argv, "--tokenizer-model-type", "gpt2", "--cache-dir", str(cache), "--append-eod"]
        )
        == 0
    )
    for ext in (".bin", ".idx"):
        ours = (tmp_path / f"o_text_document{ext}").read_bytes()
        assert ours == (MMAP / f"megatron_text_document{ext}").read_bytes()
    assert len(MMapIndexedDataset(tmp_path / "o_text_document")) == 19
