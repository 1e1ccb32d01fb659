"""Evaluation against perplexities and accuracies computed by hand, one target at a time."""

import json
import math
import subprocess
import sys

import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.inference.engine import InferenceModel
from megatron.inference.evaluation import (
    evaluate_lambada,
    evaluate_loose_json,
    evaluate_wikitext,
    fit_lambada,
    wikitext_detokenize,
    window_plan,
)
from megatron.model.context import BuildContext
from megatron.models.gpt.model import build_model
from tests.helpers.paths import MMAP, ROOT
from tests.helpers.serving import WIKI

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=8192,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=MMAP / "vocab.json", merge_file=MMAP / "merges.txt"
    )
    chunks = build_model(CFG, BuildContext(seed=7))
    engine = InferenceModel(chunks, mpu.single_process_state(), CFG.vocab_size, CFG.hidden_size)
    return tok, engine, chunks[0]


def _log_prob(model, context: list[int], target: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([context]))[0, -1, : CFG.vocab_size].double()
    return float(logits.log_softmax(-1)[target])


def _hand_nll(model, tokens, seq, stride) -> float:
    """Each target t scored once, with the context of the window Megatron-style striding gives."""
    total = 0.0
    for t in range(1, len(tokens)):
        start = 0 if t <= seq else math.ceil((t - seq) / stride) * stride
        total -= _log_prob(model, tokens[start:t], tokens[t])
    return total


@pytest.mark.parametrize(
    "n,seq,stride", [(10, 4, 4), (10, 4, 2), (5, 8, 8), (11, 4, 3), (40, 16, 5)]
)
def test_window_plan_scores_every_target_once(n, seq, stride):
    covered = [
        t
        for s, length, first in window_plan(n, seq, stride)
        for t in range(s + 1 + first, s + length + 1)
    ]
    assert covered == list(range(1, n))


def test_wikitext_detokenizer():
    assert (
        wikitext_detokenize(" guest @-@ starring role , 2 @,@ 000 ( a ) .")
        == " guest-starring role, 2,000 (a)."
    )


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("stride", [16, 5])
def test_wikitext_ppl_and_adjusted_ppl_match_a_hand_computation(setup, stride):
    tok, engine, model = setup
    result = evaluate_wikitext(engine, tok, WIKI, CFG.seq_length, stride, batch_size=3)
    tokens = tok.tokenize(wikitext_detokenize(WIKI))
    nll = _hand_nll(model, tokens, CFG.seq_length, stride)
    words = len(WIKI.strip().split(" "))
    assert result["num_tokens"] == len(tokens) and result["num_original_tokens"] == words
    assert result["ppl"] == pytest.approx(math.exp(nll / (len(tokens) - 1)), rel=1e-5)
    assert result["adjusted_ppl"] == pytest.approx(math.exp(nll / (words - 1)), rel=1e-5)


@pytest.mark.slow  # over a second on 2 cores
def test_loose_json_ppl_covers_documents_and_eod(setup):
    tok, engine, model = setup
    docs = ["def add(a, b):\n    return a + b\n", "The quick brown fox."]
    result = evaluate_loose_json(engine, tok, docs, CFG.seq_length, 16, batch_size=2)
    tokens = [t for d in docs for t in tok.tokenize(d) + [tok.eod]]
    nll = _hand_nll(model, tokens, CFG.seq_length, 16)
    assert result["ppl"] == pytest.approx(math.exp(nll / (len(tokens) - 1)), rel=1e-5)


def test_lambada_accuracy_matches_the_model_argmax(setup):
    tok, engine, model = setup
    contexts = [
        "The quick brown fox jumps over the lazy",
        "def main(args):\n    return",
        "Pipeline parallelism splits the",
        "A tensor is split across the",
    ]
    texts, expected = [], []
    for i, ctx in enumerate(contexts):
        ids = tok.tokenize(ctx)
        with torch.no_grad():
            best = int(model(torch.tensor([ids]))[0, -1, : CFG.vocab_size].argmax())
        target = best if i % 2 == 0 else (best + 1) % CFG.vocab_size  # half right, half wrong
        text = tok.detokenize(ids + [target])
        if tok.tokenize(text) != ids + [target]:
            continue  # BPE would re-merge this text differently; not a clean example
        texts.append(text)
        expected.append(target == best)
    assert len(texts) >= 2 and any(expected) and not all(expected)
    result = evaluate_lambada(engine, tok, texts, strict=False)
    assert result["accuracy"] == pytest.approx(sum(expected) / len(expected))
    strict = evaluate_lambada(engine, tok, ["one two three", "alpha beta gamma"], strict=True)
    manual = 0
    for text in ("one two three", "alpha beta gamma"):
        ctx, word = tok.tokenize(text[: text.rfind(" ")]), tok.tokenize(text[text.rfind(" ") :])
        with torch.no_grad():
            pred = model(torch.tensor([ctx + word]))[0, :, : CFG.vocab_size].argmax(-1)
        manual += pred[len(ctx) - 1 : -1].tolist() == word
    assert strict["accuracy"] == manual / 2


def test_lambada_longer_than_the_positions_keeps_its_target_and_drops_context(setup):
    tok, engine, model = setup
    text = " ".join(["the cat sat on the mat and"] * 6) + " ran"
    tokens = tok.tokenize(text)
    assert len(tokens) - 1 > CFG.seq_length  # past the 16 positions: an IndexError before
    warnings = []
    result = evaluate_lambada(engine, tok, [text, "one two three"], False, warn=warnings.append)
    assert result["num_truncated"] == 1 and result["num_examples"] == 2
    kept = tokens[-(CFG.seq_length + 1) :]  # the target and the 16 tokens before it
    nll = -_log_prob(model, kept[:-1], kept[-1])
    short = tok.tokenize("one two three")
    nll -= _log_prob(model, short[:-1], short[-1])
    assert result["ppl"] == pytest.approx(math.exp(nll / 2), rel=1e-5)
    assert f"example 0: {len(tokens)} tokens ({len(tokens) - 1} context + 1 target)" in warnings[0]
    assert f"last {CFG.seq_length} context tokens" in warnings[0]
    assert warnings[1] == "1 of 2 LAMBADA examples lost context from the left"
    narrower = evaluate_lambada(engine, tok, [text], False, seq_length=8, warn=warnings.append)
    kept = tokens[-9:]
    assert narrower["ppl"] == pytest.approx(math.exp(-_log_prob(model, kept[:-1], kept[-1])))


def test_lambada_target_that_cannot_fit_names_the_example_and_lengths():
    fitted, cut = fit_lambada([([1, 2, 3, 4], 2)], 3, ["x"], warn=None)
    assert (fitted, cut) == ([([1, 2, 3, 4], 2)], 0)  # exactly 3 inputs: untouched
    fitted, cut = fit_lambada([([1, 2, 3, 4, 5], 3)], 3, ["x"], warn=lambda m: None)
    assert (fitted, cut) == ([([2, 3, 4, 5], 3)], 1)  # one context token left: still fits
    with pytest.raises(
        ValueError,
        match=r"LAMBADA a.jsonl:7: 6 tokens, 4 of them the target.*"
        r"needs 5 tokens, more than --seq-length 3 \+ 1",
    ):
        fit_lambada([([1, 2, 3, 4, 5, 6], 4)], 3, ["a.jsonl:7"], warn=None)
    with pytest.raises(ValueError, match="LAMBADA example 0: one token"):
        fit_lambada([([1], 1)], 3, ["example 0"], warn=None)


def test_tasks_main_lambada_warns_about_a_long_example(checkpoint, tmp_path):
    data = tmp_path / "lambada.jsonl"
    long = " ".join(["the cat sat on the mat and"] * 20) + " ran"  # 200+ tokens, 64 positions
    data.write_text(json.dumps({"text": "one two three"}) + "\n\n" + json.dumps({"text": long}))
    args = ["--task", "LAMBADA", "--valid-data", str(data), "--load", checkpoint]
    out = subprocess.run(
        [sys.executable, str(ROOT / "tasks" / "main.py"), *args, "--strict-lambada"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"warning: LAMBADA example 1 ({data}:3): 202 tokens (200 context + 2 target)" in (
        out.stderr
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["num_examples"] == 2 and result["num_truncated"] == 1


@pytest.mark.slow
def test_evaluate_cli_prints_a_final_json_line(checkpoint, tmp_path):
    (tmp_path / "wiki.tokens").write_text(WIKI)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "evaluate.py"),
            "--task",
            "wikitext",
            "--valid-data",
            str(tmp_path / "wiki.tokens"),
            "--load",
            checkpoint,
            "--overlapping-eval",
            "16",
            "--seq-length",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["task"] == "wikitext" and result["ppl"] > 1 and "adjusted_ppl" in result
    assert "\r" not in out.stderr  # not a terminal: no bar redrawn in place, plain lines only
