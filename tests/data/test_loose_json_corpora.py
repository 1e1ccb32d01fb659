"""Training straight from loose JSON (--train-data NAME_OR_PATH --cache-dir): the cached corpus
trains exactly like preprocessing by hand + --data-path, the cache is reused and rebuilt when the
source changes, corpus names come from a corpora file, and bad input fails with nothing cached."""

import dataclasses
import json
import os
import random

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.data import preprocess, vocab_builder
from megatron.data.loose_json import CorpusError, prepare_loose_json
from tests.helpers.distributed import run_distributed

WORDS = "the cat sat on a mat and dog ran to big red sun we see it all day".split()


def write_jsonl(path, n_docs, seed, key="text"):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            start = rng.randrange(len(WORDS))
            words = [WORDS[(start + i) % len(WORDS)] for i in range(rng.randrange(4, 20))]
            f.write(json.dumps({key: " ".join(words)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("loose")
    a = write_jsonl(root / "a.jsonl", 300, 0)
    b = write_jsonl(root / "b.jsonl", 100, 1)
    vocab_builder.train_char(
        vocab_builder_docs([a, b]), root, min_frequency=1, specials=None, lowercase=True
    )
    return {"root": root, "a": a, "b": b, "vocab": str(root / "vocab.txt")}


def vocab_builder_docs(paths):
    for p in paths:
        with open(p, encoding="utf-8") as f:
            yield from (json.loads(line)["text"] for line in f)


def tok_flags(corpus):
    return ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab"]]


def train_flags(corpus, *data, iters=4):
    model = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
    run = (
        "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 1 "
        "--hidden-dropout 0 --attention-dropout 0 --split 90,10,0 --eval-interval 100 "
        "--eval-iters 1 --num-workers 0 --log-interval 1 --seed 7 --make-vocab-size-divisible-by 8"
    )
    return [*model.split(), *run.split(), "--train-iters", str(iters), *tok_flags(corpus), *data]


def _train_runs(rank, world, runs):
    """Each run: (argv, environment) -> its losses and what it printed, in one process."""
    import contextlib
    import io

    from megatron.config.rules import validate
    from megatron.training.loop import pretrain

    out = []
    for argv, env in runs:
        os.environ.update(env)
        cfg = parse_args(argv, world_size=world)
        validate(cfg, "train-gpt")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = pretrain(cfg, out=open(os.devnull, "w"))
        out.append(([h["lm_loss"] for h in result.history], printed.getvalue()))
    return out


def test_loose_json_trains_like_data_path_and_the_cache_is_reused_and_rebuilt(corpus, tmp_path):
    # By hand: tools/preprocess_data.py, then --data-path.
    by_hand = str(tmp_path / "hand")
    argv = ["--input", corpus["a"], "--output-prefix", by_hand, "--append-eod", *tok_flags(corpus)]
    assert preprocess.main(argv) == 0
    cache = str(tmp_path / "cache")
    source = str(tmp_path / "src.jsonl")
    with open(corpus["a"]) as f, open(source, "w") as g:
        g.write(f.read())
    loose = ["--train-data", source, "--cache-dir", cache]
    old_ways = ["--lazy-loader", "--resume-dataloader"]
    runs = [
        (train_flags(corpus, "--data-path", f"{by_hand}_text_document"), {}),
        (train_flags(corpus, *loose), {}),  # tokenizes once
        (train_flags(corpus, *loose, *old_ways), {}),  # reuses the cache
    ]
    [((hand, _), (first, log1), (again, log2))] = run_distributed(_train_runs, 1, runs)
    assert first == hand, "the cached corpus must train exactly like preprocessing by hand"
    assert again == hand, "--lazy-loader/--resume-dataloader change nothing"
    assert "tokenizing corpus 'src'" in log1 and "reusing" in log2 and "tokenizing" not in log2
    entries = os.listdir(os.path.join(cache, "loose_json"))
    assert len([e for e in entries if not e.startswith(".")]) == 1

    # The source changes: the entry is rebuilt (saying why) and holds the new documents.
    with open(source, "a") as f:
        f.write(json.dumps({"text": "the dog sat on the red mat"}) + "\n")
    cfg = parse_args(train_flags(corpus, *loose), world_size=1)
    said = []
    data = prepare_loose_json(cfg.data, None, is_builder=True, share=lambda s: s, log=said.append)
    assert "rebuilding" in said[0] and "changed size" in said[0]
    from megatron.data.indexed_dataset import MMapIndexedDataset

    assert len(MMapIndexedDataset(data.data_path[0])) == 301
    assert [e for e in os.listdir(os.path.join(cache, "loose_json")) if ".tmp-" in e] == []


def _resolve(corpus, *flags, env=None):
    cfg = parse_args([*tok_flags(corpus), *flags], world_size=1)
    return prepare_loose_json(cfg.data, None, is_builder=True, share=lambda s: s, log=print)


def test_corpus_names_blends_and_valid_test_sets(corpus, tmp_path, monkeypatch):
    names = tmp_path / "corpora.yaml"
    names.write_text(
        f"wiki: {corpus['a']}\nweb: [{corpus['b']}]\nzh:\n  paths: {corpus['b']}\n  weight: 2\n"
    )
    cache = ["--cache-dir", str(tmp_path / "cache")]
    # Several names blend by their token counts.
    data = _resolve(corpus, "--train-data", "wiki", "web", "--corpora-file", str(names), *cache)
    (w1, p1, w2, p2) = data.data_path
    assert "wiki-" in p1 and "web-" in p2 and float(w1) > 2 * float(w2) > 0
    # Weights on the command line win; the environment variable names the file too.
    monkeypatch.setenv("MEGATRON_CORPORA", str(names))
    data = _resolve(corpus, "--train-data", "0.3", "wiki", "0.7", "web", *cache)
    assert [float(data.data_path[0]), float(data.data_path[2])] == [0.3, 0.7]
    # --valid-data/--test-data make separate sets (--split unused), like --*-data-path.
    data = _resolve(
        corpus, "--train-data", "wiki", "--valid-data", "zh", "--test-data", "web", *cache
    )
    assert data.data_path == () and "wiki-" in data.train_data_path[0]
    assert "zh-" in data.valid_data_path[0] and "web-" in data.test_data_path[0]
    # Some weighted, some not: refused.
    with pytest.raises(ConfigError, match="some corpora have a weight"):
        _resolve(corpus, "--train-data", "zh", "wiki", *cache)
    # An unknown name lists the known ones.
    with pytest.raises(ConfigError, match=r"unknown corpus 'wikipedia'.*: web, wiki, zh"):
        _resolve(corpus, "--train-data", "wikipedia", *cache)
    monkeypatch.delenv("MEGATRON_CORPORA")
    with pytest.raises(ConfigError, match="no corpora file"):
        _resolve(corpus, "--train-data", "wikipedia", *cache)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--train-data", "x", "--data-path", "p"],
            "--train-data: given together with --data-path",
        ),
        (["--valid-data", "x", "--cache-dir", "c"], "--valid-data: needs --train-data"),
        (["--train-data", "x"], "--train-data: .*--cache-dir, which is not set"),
        (["--train-data", "x", "--test-data-path", "p"], "given together with --test-data-path"),
        (["--train-data", "0.5", "x", "y", "--cache-dir", "c"], "weight/name pairs"),
    ],
)
def test_contradictions_fail_naming_both_flags(corpus, flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*tok_flags(corpus), *flags], world_size=1)


def test_bad_input_fails_clearly_and_caches_nothing(corpus, tmp_path):
    # A record without the text key: named by file and line; no entry, no temporary directory.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"body": "no text here"}\n{"text": "a dog"}\n')
    cache = tmp_path / "cache"
    with pytest.raises(CorpusError, match=rf"{bad}:2: .*text"):
        _resolve(corpus, "--train-data", str(bad), "--cache-dir", str(cache))
    assert os.listdir(cache / "loose_json") == []
    # The same with another --text-key is fine.
    bad.write_text('{"body": "the cat"}\n')
    data = _resolve(
        corpus, "--train-data", str(bad), "--text-key", "body", "--cache-dir", str(cache)
    )
    assert data.data_path[0].endswith("_body_document")
    # A cache dir that cannot be written.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--cache-dir .*a-file/cache: cannot write"):
        _resolve(corpus, "--train-data", corpus["a"], "--cache-dir", str(blocker / "cache"))
    # A missing path (no corpora file): a clear error.
    with pytest.raises(ConfigError, match="unknown corpus 'nothing.jsonl'"):
        _resolve(corpus, "--train-data", "nothing.jsonl", "--cache-dir", str(cache))


def test_presplit_sentences_keep_lines_as_sentences(corpus, tmp_path):
    src = tmp_path / "bert.jsonl"
    src.write_text(
        json.dumps({"text": "the cat sat\non a mat\n\nthe dog ran"})
        + "\n"
        + json.dumps({"text": "we see it"})
        + "\n"
    )
    data = _resolve(
        corpus, "--train-data", str(src), "--presplit-sentences", "--cache-dir", str(tmp_path / "c")
    )
    from megatron.data.indexed_dataset import MMapIndexedDataset

    ds = MMapIndexedDataset(data.data_path[0])
    assert data.data_path[0].endswith("_text_sentence")
    # Character tokens, one sequence per non-empty line, no end-of-document token.
    assert list(ds.sizes) == [9, 6, 9, 7] and list(ds.doc_idx) == [0, 3, 4]


def test_dataclass_replace_keeps_other_fields(corpus, tmp_path):
    cfg = parse_args(
        [
            *tok_flags(corpus),
            "--train-data",
            corpus["a"],
            "--cache-dir",
            str(tmp_path),
            "--split",
            "8,1,1",
        ],
        world_size=1,
    )
    data = prepare_loose_json(cfg.data, None, is_builder=True, share=lambda s: s, log=print)
    assert dataclasses.replace(data, data_path=cfg.data.data_path) == cfg.data
