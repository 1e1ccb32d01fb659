"""The GPT2-Chinese workflow end to end, offline: a character vocabulary from the corpus
(tools/train_tokenizer.py --type char) -> preprocess a JSON array (tools/preprocess_data.py) ->
train with 2 data-parallel ranks -> generate (tools/generate_text.py), and the text comes back
as Chinese characters with no spaces inserted between them."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.data import preprocess
from megatron.data.tokenizers import build_tokenizer
from megatron.data.wordpiece_text import is_cjk_char
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT, load_tool

train_tokenizer = load_tool("train_tokenizer")


def chinese_corpus(path: Path, n_docs: int = 200) -> list[str]:
    """A JSON array of documents made of 60 phrases over 300 distinct characters."""
    rng = random.Random(0)
    chars = [chr(0x4E00 + 37 * i) for i in range(300)]
    phrases = ["".join(chars[(5 * p + k) % 300] for k in range(5)) for p in range(60)]
    docs = []
    for _ in range(n_docs):
        start = rng.randrange(60)
        words = [phrases[(start + i) % 60] for i in range(rng.randrange(3, 12))]
        docs.append("，".join(words) + "。")
    path.write_text(json.dumps(docs, ensure_ascii=False), encoding="utf-8")
    return docs


def flags(tok, *data, save=None):
    argv = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 8 --lr 5e-3 "
        "--lr-warmup-iters 1 --hidden-dropout 0 --attention-dropout 0 --split 95,5,0 "
        "--eval-interval 100 --eval-iters 1 --num-workers 0 --log-interval 1 --seed 3 "
        "--make-vocab-size-divisible-by 8"
    ).split()
    argv += ["--tokenizer-type", "BertWordPieceCase", "--vocab-file", tok, *data]
    return argv + (["--save", save, "--save-interval", "8"] if save else [])


def _dp2_runs(rank, world, runs):
    """Each run's losses, or its error message, on this rank (one spawn for all of them)."""
    from megatron.config.cli import parse_args
    from megatron.config.rules import validate
    from megatron.training.loop import pretrain

    out = []
    for argv in runs:
        try:
            cfg = parse_args(argv, world_size=world)
            validate(cfg, "train-gpt")
            result = pretrain(cfg, out=open(os.devnull, "w"))
            out.append([h["lm_loss"] for h in result.history])
        except ValueError as e:
            out.append(f"error: {e}")
    return out


@pytest.mark.slow
def test_chinese_vocab_preprocess_train_dp2_generate(tmp_path):
    train_json = tmp_path / "train.json"
    docs = chinese_corpus(train_json)
    # 1. vocabulary (make_vocab.sh): every character, plus BERT's special tokens
    tok_dir = tmp_path / "tok"
    argv = ["--input", str(train_json), "--type", "char", "--output-dir", str(tok_dir)]
    assert train_tokenizer.main(argv) == 0
    vocab = (tok_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert {"[UNK]", "[SEP]", "，", "。"} <= set(vocab) and len([v for v in vocab if v]) == 307
    tok = str(tok_dir / "vocab.txt")
    tokenizer = build_tokenizer("BertWordPieceCase", vocab_file=tok)
    assert tokenizer.detokenize(tokenizer.tokenize(docs[0])) == docs[0]  # no spaces inserted
    # 2. preprocess the JSON array
    prefix = str(tmp_path / "zh")
    pre = ["--input", str(train_json), "--output-prefix", prefix, "--append-eod"]
    assert (
        preprocess.main([*pre, "--tokenizer-type", "BertWordPieceCase", "--vocab-file", tok]) == 0
    )
    # 3. train on 2 DP ranks: from the preprocessed files, and straight from the JSON array
    #    through --train-data (rank 0 tokenizes into --cache-dir once, rank 1 waits); a corpus
    #    with a bad record fails on both ranks with its file and line, caching nothing.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(["分布式", {"title": "无"}], ensure_ascii=False), encoding="utf-8")
    cache = str(tmp_path / "cache")
    ckpt = str(tmp_path / "ckpt")
    runs = [
        flags(tok, "--train-data", str(bad), "--cache-dir", cache),
        flags(tok, "--data-path", f"{prefix}_text_document", save=ckpt),
        flags(tok, "--train-data", str(train_json), "--cache-dir", cache),
    ]
    ranks = run_distributed(_dp2_runs, 2, runs)
    for failed, by_hand, loose in ranks:
        assert failed.startswith("error:") and f"{bad}:1: missing key 'text'" in failed, failed
        assert "1 bad record(s), nothing was cached" in failed
        assert by_hand == loose and by_hand[-1] < by_hand[0]
    assert ranks[0][1] == ranks[1][1]
    assert sorted(os.listdir(Path(cache) / "loose_json"))[-1].startswith("train-")
    assert not [e for e in os.listdir(Path(cache) / "loose_json") if e.startswith(".")]
    # 4. generate from the checkpoint with the prompt interface
    gen = [sys.executable, str(ROOT / "tools" / "generate_text.py"), "--load", ckpt]
    gen += ["--prompt", docs[0][:4], "--max-new-tokens", "12", "--greedy"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(gen, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = json.loads(proc.stdout.strip().splitlines()[-1])["text"]
    chars = text.replace("[SEP]", "")
    assert chars and " " not in text and all(is_cjk_char(c) for c in chars), text


def test_char_and_wordpiece_vocabularies_from_jsonl_json_and_text(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "distributed training 分布式训练"}, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    (tmp_path / "b.txt").write_text("training runs\n训练很快\n", encoding="utf-8")
    (tmp_path / "c.json").write_text(json.dumps(["训练", "runs 快"], ensure_ascii=False))
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.txt", "c.json")]
    # char: only characters seen at least --min-frequency times (训, 练 appear 3 times)
    out = tmp_path / "char"
    args = ["--input", *inputs, "--type", "char", "--min-frequency", "3", "--output-dir", str(out)]
    assert train_tokenizer.main(args) == 0
    vocab = (out / "vocab.txt").read_text(encoding="utf-8").split()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert "训" in vocab and "练" in vocab and "分" not in vocab and "##n" in vocab
    # wordpiece: Latin words keep their spaces, CJK comes back without inserted ones
    out = tmp_path / "wp"
    args = ["--input", *inputs, "--type", "wordpiece", "--vocab-size", "80", "--lowercase"]
    assert train_tokenizer.main([*args, "--output-dir", str(out)]) == 0
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=out / "vocab.txt")
    text = "distributed training runs 分布式训练很快"
    assert tok.detokenize(tok.tokenize(text)) == "distributed training runs分布式训练很快"
    assert tok.detokenize(tok.tokenize("training runs")) == "training runs"
