"""Zero-shot evaluations of Megatron's tasks/zeroshot_gpt: WikiText perplexity, LAMBADA cloze
accuracy, and perplexity over a loose-JSON corpus, on any TP x PP layout.

Perplexity over a long token stream uses windows of seq_length tokens moved by `stride`
(--overlapping-eval): each target token is scored once, by the first window that contains it
with the most context (all of the first window's targets; then only the last `stride`).
WikiText reports the token-level perplexity and the word-level "adjusted" one, which rescales
the mean loss by (tokens - 1) / (original words - 1) so numbers compare across tokenizers.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable

import torch

from megatron.inference.engine import InferenceModel
from megatron.progress import Progress

_WIKITEXT_RULES = [  # the word-level WikiText files' tokenization, undone
    (" @-@ ", "-"),
    (" @,@ ", ","),
    (" @.@ ", "."),
    (" : ", ": "),
    (" ; ", "; "),
    (" . ", ". "),
    (" ! ", "! "),
    (" ? ", "? "),
    (" , ", ", "),
    (" 's", "'s"),
    ("= = = =", "===="),
    ("= = =", "==="),
    ("= =", "=="),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),
]


def wikitext_detokenize(text: str) -> str:
    text = re.sub(r"\( ([^)]*) \)", r"(\1)", text)
    text = re.sub(r'" ([^"]*) "', r'"\1"', text)
    text = re.sub(r"\[ ([^\]]*) \]", r"[\1]", text)
    for old, new in _WIKITEXT_RULES:
        text = text.replace(old, new)
    return re.sub(r" ([.,;:!?])(?=\s|$)", r"\1", text)  # "word ." -> "word."


def window_plan(num_tokens: int, seq_length: int, stride: int) -> list[tuple[int, int, int]]:
    """[(start, length, first scored)] covering targets 1 .. num_tokens - 1 exactly once.

    A window holds inputs tokens[start : start + length] and targets one further on; only its
    targets from `first scored` on (relative to the window) count.
    """
    if not 0 < stride <= seq_length:
        raise ValueError(f"--overlapping-eval {stride} must be in [1, --seq-length {seq_length}]")
    plan, next_target, start = [], 1, 0
    while next_target <= num_tokens - 1:
        length = min(seq_length, num_tokens - 1 - start)
        plan.append((start, length, next_target - (start + 1)))
        next_target = start + length + 1
        start += stride
    return plan


def stream_nll(
    engine: InferenceModel,
    tokens: list[int],
    seq_length: int,
    stride: int,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
    max_batches: int | None = None,
) -> tuple[float, int]:
    """(sum of the negative log-likelihood, number of targets scored) over the stream: every
    target token, or those of the first `max_batches` batches of windows."""
    plan = window_plan(len(tokens), seq_length, stride)
    if max_batches is not None:
        plan = plan[: max_batches * batch_size]
    ids = torch.tensor(tokens, device=engine.device)
    total, scored = 0.0, 0
    for i in range(0, len(plan), batch_size):
        group = plan[i : i + batch_size]
        for length in sorted({g[1] for g in group}):  # equal-length windows batch together
            same = [g for g in group if g[1] == length]
            x = torch.stack([ids[s : s + length] for s, _, _ in same])
            y = torch.stack([ids[s + 1 : s + length + 1] for s, _, _ in same])
            losses, _ = engine.token_losses(x, y)
            for row, (_, _, first) in enumerate(same):
                total += float(losses[row, first:].double().sum())
                scored += length - first
        if progress:
            progress(min(i + batch_size, len(plan)), len(plan))
    return total, scored


def evaluate_wikitext(
    engine, tokenizer, text: str, seq_length: int, stride: int, batch_size: int, progress=None
) -> dict:
    words = len(text.strip().split(" "))  # the original word-level tokens, as Megatron counts
    tokens = tokenizer.tokenize(wikitext_detokenize(text))
    nll, _ = stream_nll(engine, tokens, seq_length, stride, batch_size, progress)
    loss = nll / (len(tokens) - 1)
    ratio = (len(tokens) - 1) / (words - 1)
    return {
        "task": "wikitext",
        "loss": loss,
        "ppl": math.exp(min(20.0, loss)),
        "adjusted_ppl": math.exp(min(20.0, loss * ratio)),
        "num_tokens": len(tokens),
        "num_original_tokens": words,
        "token_ratio": ratio,
    }


def evaluate_loose_json(
    engine,
    tokenizer,
    docs: list[str],
    seq_length: int,
    stride: int,
    batch_size: int,
    progress=None,
    max_batches: int | None = None,
) -> dict:
    """Perplexity of the documents joined with end-of-document, over every target or those of
    the first `max_batches` batches of windows (the 2019 --webtext-eval --eval-iters)."""
    tokens = []
    for doc in docs:
        tokens += tokenizer.tokenize(doc) + [tokenizer.eod]
    nll, scored = stream_nll(engine, tokens, seq_length, stride, batch_size, progress, max_batches)
    loss = nll / scored
    return {
        "task": "loose-json",
        "loss": loss,
        "ppl": math.exp(min(20.0, loss)),
        "num_tokens": len(tokens),
        "num_scored": scored,
    }


def lambada_example(tokenizer, text: str, strict: bool) -> tuple[list[int], int]:
    """(tokens, number of target tokens at the end). Strict: the whole last word; otherwise
    the last token of the text."""
    text = text.strip()
    if strict:
        cut = text.rfind(" ")
        if cut < 0:
            raise ValueError(f"LAMBADA example without a space: {text[:60]!r}")
        context, target = tokenizer.tokenize(text[:cut]), tokenizer.tokenize(text[cut:])
        return context + target, len(target)
    return tokenizer.tokenize(text), 1


def fit_lambada(
    examples: list[tuple[list[int], int]],
    seq_length: int,
    labels: list[str],
    warn: Callable[[str], None],
) -> tuple[list[tuple[list[int], int]], int]:
    """(examples cut to at most `seq_length` inputs, how many were cut).

    The model reads tokens[:-1] to predict tokens[1:], so an example may hold seq_length + 1
    tokens. A longer one keeps its whole target and loses context from the left (one warning
    each). One whose target leaves no context token before it cannot be scored: an error.
    """
    fitted, cut = [], 0
    for (tokens, n), label in zip(examples, labels, strict=True):
        if len(tokens) < 2:
            raise ValueError(f"LAMBADA {label}: one token, no context to predict it from")
        if n > seq_length:
            raise ValueError(
                f"LAMBADA {label}: {len(tokens)} tokens, {n} of them the target; the target "
                f"with one context token before it needs {n + 1} tokens, more than "
                f"--seq-length {seq_length} + 1 (inputs and the next token). Fix: raise "
                "--seq-length (up to the model's positions) or drop the example"
            )
        if len(tokens) - 1 > seq_length:
            keep = seq_length + 1
            warn(
                f"LAMBADA {label}: {len(tokens)} tokens ({len(tokens) - n} context + {n} "
                f"target) make {len(tokens) - 1} inputs, more than --seq-length {seq_length}; "
                f"kept the target and the last {keep - n} context tokens"
            )
            tokens, cut = tokens[-keep:], cut + 1
        fitted.append((tokens, n))
    return fitted, cut


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def evaluate_lambada(
    engine,
    tokenizer,
    texts: list[str],
    strict: bool,
    progress=None,
    batch_size: int = 1,
    *,
    seq_length: int | None = None,
    labels: list[str] | None = None,
    warn: Callable[[str], None] = _stderr_warning,
) -> dict:
    """Accuracy (every target token is the argmax) and perplexity of the targets. Examples run
    `batch_size` at a time, padded on the right with end-of-document: causal attention never
    lets the padding reach the scored positions. Examples longer than `seq_length` inputs (the
    model's positions by default) lose context from the left (fit_lambada); `labels` name the
    examples in its messages (default: "example i", counted from 0)."""
    examples = [lambada_example(tokenizer, text, strict) for text in texts]
    seq_length = seq_length or engine.model.cfg.max_positions
    labels = labels or [f"example {i}" for i in range(len(texts))]
    examples, truncated = fit_lambada(examples, seq_length, labels, warn)
    if truncated:
        warn(f"{truncated} of {len(examples)} LAMBADA examples lost context from the left")
    correct, nll, scored = 0, 0.0, 0
    for i in range(0, len(examples), batch_size):
        group = examples[i : i + batch_size]
        width = max(len(tokens) for tokens, _ in group)
        ids = torch.full((len(group), width), tokenizer.eod, device=engine.device)
        for row, (tokens, _) in enumerate(group):
            ids[row, : len(tokens)] = torch.tensor(tokens, device=engine.device)
        losses, argmax = engine.token_losses(ids[:, :-1], ids[:, 1:])  # (b, width - 1)
        for row, (tokens, n) in enumerate(group):
            end = len(tokens) - 1  # targets tokens[1:] sit at positions 0 .. end - 1
            correct += bool((argmax[row, end - n : end] == ids[row, end - n + 1 : end + 1]).all())
            nll += float(losses[row, end - n : end].double().sum())
            scored += n
        if progress:
            progress(min(i + batch_size, len(examples)), len(examples))
    return {
        "task": "lambada",
        "accuracy": correct / len(texts),
        "num_examples": len(texts),
        "ppl": math.exp(min(20.0, nll / scored)),
        "num_tokens": scored,
        "num_truncated": truncated,
    }


def progress_bar(label: str, enabled: bool):
    """`show(done, total)`: a tqdm bar on a terminal, plain lines in a log (megatron/progress)."""
    if not enabled:
        return lambda done, total: None
    return Progress(label)


def read_jsonl_records(path: str, key: str = "text") -> list[tuple[int, str]]:
    """[(line number, text)] of a JSONL file's non-blank lines."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append((n, json.loads(line)[key]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with {key!r} ({e})") from None
    if not records:
        raise ValueError(f"{path}: no examples")
    return records


def read_jsonl_texts(path: str, key: str = "text") -> list[str]:
    return [text for _, text in read_jsonl_records(path, key)]
