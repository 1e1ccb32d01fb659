"""Tokenizers give Megatron-LM's ids; trained tokenizers load back; bad input names its flag."""

import gzip
import json
import pickle
import re
import sys

import pytest

from megatron.config.schema_data import TOKENIZER_TYPES
from megatron.data.tokenizers import build_tokenizer
from tests.helpers.paths import MMAP, ROOT, load_tool

DOCS = [json.loads(line)["text"] for line in (MMAP / "corpus.jsonl").open(encoding="utf-8")]
EXPECTED = json.loads((MMAP / "expected_ids.json").read_text(encoding="utf-8"))


train_tokenizer = load_tool("train_tokenizer")


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=MMAP / "vocab.json",
        merge_file=MMAP / "merges.txt",
    )


def test_gpt2_bpe_reproduces_megatron_ids(gpt2):
    assert len(EXPECTED["documents"]) == len(DOCS) == 19
    assert gpt2.eod == EXPECTED["eod"] == 0 and gpt2.vocab_size == 8192
    for text, expected in zip(DOCS, EXPECTED["documents"], strict=True):
        assert gpt2.tokenize(text) + [gpt2.eod] == expected


def test_gpt2_bpe_round_trips_and_batches(gpt2):
    for text in DOCS:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    assert gpt2.tokenize_batch(DOCS) == [gpt2.tokenize(t) for t in DOCS]
    assert gpt2.tokenize_batch([]) == []


@pytest.mark.parametrize("form", ["file", "directory"])
def test_huggingface_tokenizer_json_gives_megatron_ids(form):
    path = MMAP / "tokenizer.json" if form == "file" else MMAP
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    assert (tok.eod, tok.vocab_size) == (0, 8192)
    assert [ids + [tok.eod] for ids in tok.tokenize_batch(DOCS)] == EXPECTED["documents"]


def test_tokenizer_pickles_as_its_build_args(gpt2):
    """Worker processes receive the recipe, not the tables, and get the same ids."""
    clone = pickle.loads(pickle.dumps(gpt2))
    assert clone.tokenize(DOCS[3]) == gpt2.tokenize(DOCS[3])
    name, kwargs = gpt2.build_args
    assert build_tokenizer(name, **kwargs).tokenize(DOCS[0]) == gpt2.tokenize(DOCS[0])


@pytest.fixture
def bert_vocab(tmp_path):
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "Hello", "world", "##s"]
    pieces += [",", "!", "分", "布", "式", "训", "练"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(pieces) + "\n", encoding="utf-8")
    return path, {p: i for i, p in enumerate(pieces)}


def test_bert_wordpiece_case_and_chinese_characters(bert_vocab):
    path, v = bert_vocab
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=path)
    cased = build_tokenizer("BertWordPieceCase", vocab_file=path)
    assert lower.eod == cased.eod == v["[SEP]"] and lower.vocab_size == len(v)
    tail = [v["world"], v["##s"], v[","], v["分"], v["布"], v["式"], v["训"], v["练"], v["!"]]
    text = "Hello worlds, 分布式训练!"
    assert lower.tokenize(text) == [v["hello"], *tail]  # no [CLS] / [SEP] added
    assert cased.tokenize(text) == [v["Hello"], *tail]
    assert cased.tokenize("HELLO 分x") == [v["[UNK]"], v["分"], v["[UNK]"]]
    assert lower.tokenize_batch([text, "hello"]) == [lower.tokenize(text), [v["hello"]]]
    # CJK decodes without inserted spaces (GPT2-Chinese's "分 布 式" complaint); the spaces
    # between Latin words stay. A space next to a CJK character cannot be told apart: dropped.
    assert lower.detokenize(lower.tokenize(text)) == "hello worlds,分布式训练!"
    assert lower.detokenize(lower.tokenize("hello world 分布式")) == "hello world分布式"


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize(" 3 17\n99 0 ") == [3, 17, 99, 0]
    assert tok.detokenize([3, 17, 100]) == "3 17 100"
    with pytest.raises(ValueError, match="id 100 "):
        tok.tokenize("1 100")
    with pytest.raises(ValueError, match="id -1 "):
        tok.tokenize("-1")
    with pytest.raises(ValueError, match="'x' is not an integer"):
        tok.tokenize("1 x")
    assert pickle.loads(pickle.dumps(tok)).eod == 100


def test_whitespace_tokenizer(tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, "<eod>": 2, "我们": 3, "喜欢": 10, "猫": 5}
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = build_tokenizer("WhitespaceTokenizer", vocab_file=path)
    assert (tok.vocab_size, tok.eod) == (11, 2)  # <eod> wins over </s>
    assert tok.tokenize("我们  喜欢\t狗 猫\n") == [3, 10, 0, 5]
    assert tok.detokenize([3, 10, 5]) == "我们 喜欢 猫"
    with pytest.raises(ValueError, match="id 7 is not in the vocab"):
        tok.detokenize([3, 7])


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


BAD_INPUTS = [
    ("GPT2BPETokenizer", {"merge_file": MMAP / "merges.txt"}, ValueError, "--vocab-file"),
    ("GPT2BPETokenizer", {"vocab_file": MMAP / "vocab.json"}, ValueError, "--merge-file"),
    (
        "GPT2BPETokenizer",
        {"vocab_file": MMAP / "vocab.json", "merge_file": "missing/merges.txt"},
        FileNotFoundError,
        "--merge-file missing/merges.txt does not exist",
    ),
    ("HuggingFaceTokenizer", {}, ValueError, "--tokenizer-model"),
    ("HuggingFaceTokenizer", {"tokenizer_model": "nope"}, FileNotFoundError, "--tokenizer-model"),
    ("SentencePieceTokenizer", {}, ValueError, "--tokenizer-model"),
    ("BertWordPieceCase", {"vocab_file": MMAP}, FileNotFoundError, "is a directory"),
    ("NullTokenizer", {}, ValueError, "--vocab-size"),
    ("NullTokenizer", {"vocab_size": 0}, ValueError, "--vocab-size"),
    ("WhitespaceTokenizer", {}, ValueError, "--vocab-file"),
    ("GPT-2", {}, ValueError, "--tokenizer-type 'GPT-2' is unknown; choose one of GPT2BPE"),
]


@pytest.mark.parametrize("tokenizer_type,kwargs,error,message", BAD_INPUTS)
def test_missing_arguments_name_their_flag(tokenizer_type, kwargs, error, message):
    with pytest.raises(error, match=message):
        build_tokenizer(tokenizer_type, **kwargs)


def test_unknown_type_lists_every_valid_name():
    with pytest.raises(ValueError) as info:
        build_tokenizer("gpt2")
    assert all(name in str(info.value) for name in TOKENIZER_TYPES)


def test_unreadable_files_name_their_flag(tmp_path, bert_vocab):
    junk = _write(tmp_path, "junk.json", "{not json")
    merges = MMAP / "merges.txt"
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=junk, merge_file=merges)
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("WhitespaceTokenizer", vocab_file=junk)
    with pytest.raises(ValueError, match="--vocab-file .* needs <unk>"):
        build_tokenizer("WhitespaceTokenizer", vocab_file=_write(tmp_path, "v.json", '{"a": 0}'))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=junk)
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=junk)
    no_sep = _write(tmp_path, "vocab.txt", "[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ValueError, match=r"--vocab-file .*\['\[SEP\]'\]"):
        build_tokenizer("BertWordPieceCase", vocab_file=no_sep)


def test_huggingface_tokenizer_without_eod_lists_candidates(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(path))
    with pytest.raises(ValueError, match="--tokenizer-model .*<\\|endoftext\\|>, </s>, <eos>"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)


def test_sentencepiece_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import` fail
    model = _write(tmp_path, "spm.model", "x")
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)


@pytest.fixture
def corpus(tmp_path):
    """The fixture documents as .jsonl, source lines as .txt.gz, unseen text left out."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS), encoding="utf-8")
    txt = tmp_path / "code.txt.gz"
    with gzip.open(txt, "wt", encoding="utf-8") as f:
        f.write((ROOT / "megatron" / "data" / "tokenizers.py").read_text(encoding="utf-8"))
    return [str(jsonl), str(txt)]


UNSEEN = ["Ünïcödé ∮ never seen 🙂\r\n\ttabs  and   spaces ", "", " leading space"]


def test_train_bpe_loads_as_gpt2_and_hf(tmp_path, corpus, capsys):
    out = tmp_path / "bpe"
    argv = ["--input", *corpus, "--type", "bpe", "--vocab-size", "300", "--output-dir", str(out)]
    assert train_tokenizer.main(argv) == 0
    assert "vocab.json" in capsys.readouterr().out
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=out / "vocab.json", merge_file=out / "merges.txt"
    )
    assert (tok.vocab_size, tok.eod) == (300, 0)
    for text in DOCS + UNSEEN:
        assert tok.detokenize(tok.tokenize(text)) == text
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=out)
    assert hf.tokenize_batch(DOCS) == tok.tokenize_batch(DOCS)


def test_train_sentencepiece_loads_with_eod(tmp_path, corpus):
    pytest.importorskip("sentencepiece", reason="pip install sentencepiece to test it")
    out = tmp_path / "spm"
    argv = ["--input", *corpus, "--type", "sentencepiece", "--vocab-size", "400"]
    assert train_tokenizer.main([*argv, "--output-dir", str(out)]) == 0
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=out / "spm.model")
    assert tok.vocab_size == 400
    assert tok._sp.id_to_piece(tok.eod) == "<|endoftext|>"
    for text in DOCS + UNSEEN:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize_batch(DOCS) == [tok.tokenize(t) for t in DOCS]


def test_json_array_input_is_decoded_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(train_tokenizer, "CHUNK_CHARS", 5)
    records = ['a "quoted" \\ string', {"text": "from an object"}, "分布式 🚀", ""]
    path = _write(tmp_path, "docs.json", "  [\n" + ",\n ".join(map(json.dumps, records)) + "]\n")
    texts = list(train_tokenizer.iter_documents([str(path)], ["text"]))
    assert texts == [records[0], "from an object", records[2], ""]


@pytest.mark.parametrize(
    "name,content,flags,message",
    [
        ("a.jsonl", '{"body": "x"}\n', [], "--input .*a.jsonl:1: no string under --json-keys"),
        ("a.jsonl", "{oops\n", [], "--input .*a.jsonl:1: not JSON"),
        ("a.json", '{"text": "x"}', [], "--input .*a.json: a .json input must be an array"),
        ("a.json", '["x", 3]', [], r"--input .*a.json\[1\]: expected a string"),
        ("a.txt", "x\n", ["--vocab-size", "200"], "--vocab-size must be at least 257"),
        ("a.txt", "x\n", ["--min-frequency", "0"], "--min-frequency"),
    ],
)
@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_train_tokenizer_bad_input_names_its_flag(
    tmp_path, capsys, kind, name, content, flags, message
):
    if kind == "sentencepiece":
        pytest.importorskip("sentencepiece", reason="pip install sentencepiece to test it")
    path = _write(tmp_path, name, content)
    argv = ["--input", str(path), "--type", kind, "--vocab-size", "300"]
    with pytest.raises(SystemExit):
        train_tokenizer.main([*argv, "--output-dir", str(tmp_path / "out"), *flags])
    assert re.search(message, capsys.readouterr().err)


def test_train_tokenizer_missing_input_names_flag(tmp_path, capsys):
    argv = ["--input", "nope.jsonl", "--type", "bpe", "--vocab-size", "300"]
    with pytest.raises(SystemExit):
        train_tokenizer.main([*argv, "--output-dir", str(tmp_path)])
    assert "--input nope.jsonl: no such file" in capsys.readouterr().err


def test_fast_gpt2_engine_matches_hf_and_falls_back_on_disagreement(monkeypatch):
    import numpy as np

    from megatron.data import fast_bpe

    texts = [json.loads(line)["text"] for line in (MMAP / "corpus.jsonl").open()]
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=MMAP / "vocab.json", merge_file=MMAP / "merges.txt"
    )
    assert tok._fast is not None, "tiktoken is installed with the project"
    flat, lengths = tok._fast.encode_arrays(texts)
    assert np.split(flat, np.cumsum(lengths)[:-1])[5].tolist() == tok.tokenize(texts[5])
    assert flat.tolist() == [i for t in texts for i in tok.tokenize(t)]
    # A fast engine that disagrees is caught on the first batch and HF takes over.
    tok._fast = fast_bpe.TiktokenBPE(tok._fast._enc, tok._fast._lut[::-1].copy())
    with pytest.warns(UserWarning, match="tiktoken disagrees"):
        bad_flat, _ = tok.tokenize_batch_arrays(texts)
    assert bad_flat.tolist() == flat.tolist() and tok._fast is None


def test_gpt2_bpe_with_no_files_is_gpt2s_own_offline():
    # nanoGPT / HF users expect `gpt2` with nothing to download: the package ships OpenAI's files.
    tok = build_tokenizer("GPT2BPETokenizer")
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.eod == 50256 and tok.vocab_size == 50257
    assert pickle.loads(pickle.dumps(tok)).tokenize("Hello world") == [15496, 995]


def test_gpt2_builtin_files_are_checked_by_sha256(tmp_path, monkeypatch):
    from megatron.data import gpt2_files

    for name in gpt2_files.SHA256:
        (tmp_path / name).write_bytes((gpt2_files.ASSETS / name).read_bytes() + b"\n")
    monkeypatch.setattr(gpt2_files, "ASSETS", tmp_path)
    gpt2_files.builtin_gpt2_files.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"vocab.json: sha256 .* is not GPT-2's"):
            gpt2_files.builtin_gpt2_files()
    finally:
        gpt2_files.builtin_gpt2_files.cache_clear()


def test_train_bpe_says_why_the_vocab_is_smaller_than_asked(tmp_path, capsys):
    corpus = _write(tmp_path, "tiny.txt", "to be or not to be\n" * 20)
    argv = ["--input", str(corpus), "--type", "bpe", "--vocab-size", "32000"]
    assert train_tokenizer.main([*argv, "--output-dir", str(tmp_path / "tok")]) == 0
    err = capsys.readouterr().err
    assert "not the 32,000 asked for: the corpus has no more pairs" in err, err


def test_setup_py_ships_gpt2s_files():
    from megatron.data import gpt2_files

    setup_py = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert 'package_data={"megatron.data": ["assets/gpt2/*"]}' in setup_py
    shipped = {p.name for p in gpt2_files.ASSETS.glob("*")}
    assert set(gpt2_files.SHA256) | {"LICENSE"} <= shipped
