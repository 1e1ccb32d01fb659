"""BERT samples (Megatron's recipe) from a sentence-level indexed dataset.

The corpus is PREFIX_text_sentence.bin/.idx from `tools/preprocess_data.py --split-sentences`:
one sequence per sentence, the document index marking where each document ends.

Index (built once by the builder rank, cached by hash of its description, deterministic by seed):
each epoch walks the documents of the split in order and cuts each into runs of consecutive
sentences. A run ends when its tokens reach the target length (seq_length - 3, or with
probability --short-seq-prob a random length in [2, seq_length - 3]) or the document ends; it
needs two sentences when there is an NSP head. Documents shorter than that are skipped. All runs
of all epochs are then shuffled: samples[i] = (first sentence, end sentence, target length).

Sample i (its own RNG, seeded by seed + i): the run is split at a random sentence into
segments A | B; with probability 1/2 they are swapped (NSP label 1, "not in order"). The pair is
trimmed to the target length from a random end of the longer one, laid out as
[CLS] A [SEP] B [SEP] with token types 0 / 1, and --mask-prob of its tokens (at least 1, at most
max_predictions) are chosen for prediction: 80% become [MASK], 10% a random id, 10% stay.
With whole-word masking a word's '##' pieces are chosen together. Padded to --seq-length.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megatron.data.gpt_dataset import DataError, cached_indices

INDEX_VERSION = 1


@dataclass(frozen=True)
class BertTokens:
    """The special ids a BERT sample needs, and which ids continue a word ('##' pieces)."""

    cls: int
    sep: int
    mask: int
    pad: int
    vocab_size: int
    continuation: np.ndarray | None = None  # bool (vocab_size,), for whole-word masking


@dataclass(frozen=True)
class BertOptions:
    seq_length: int
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True
    whole_word_masking: bool = False

    @property
    def max_predictions(self) -> int:
        return max(1, int(round(self.mask_prob * self.seq_length)))


def check_sentence_level(indexed, name: str) -> None:
    """A document-level corpus (one sequence per document) cannot give sentence pairs."""
    if len(indexed) and len(indexed.doc_idx) == len(indexed) + 1:
        raise DataError(
            f"{indexed.prefix}: every document is a single sequence; BERT needs the corpus split "
            "into sentences. Fix: run tools/preprocess_data.py with --split-sentences and pass "
            f"the PREFIX_text_sentence prefix (the {name} split was given a document-level one)"
        )


def build_samples(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    documents: range,
    num_samples: int,
    opts: BertOptions,
    seed: int,
) -> np.ndarray:
    """(N >= num_samples, 3) int64 rows (first sentence, end sentence, target length), shuffled."""
    rng = np.random.RandomState(seed)
    max_tokens = opts.seq_length - (3 if opts.binary_head else 2)
    min_sentences = 2 if opts.binary_head else 1
    rows: list[tuple[int, int, int]] = []
    while len(rows) < num_samples:
        before = len(rows)
        for d in documents:
            first, end = int(doc_idx[d]), int(doc_idx[d + 1])
            if end - first < min_sentences:
                continue  # too short for a pair
            target = _target_length(rng, max_tokens, opts.short_seq_prob)
            start, total = first, 0
            for s in range(first, end):
                total += int(sizes[s])
                if (total >= target or s == end - 1) and s + 1 - start >= min_sentences:
                    rows.append((start, s + 1, target))
                    start, total = s + 1, 0
                    target = _target_length(rng, max_tokens, opts.short_seq_prob)
        if len(rows) == before:
            raise DataError(
                f"no document of this split has {min_sentences} sentences; BERT samples need "
                "longer documents (or --bert-no-binary-head)"
            )
    out = np.asarray(rows, dtype=np.int64)
    return out[rng.permutation(len(out))]


def _target_length(rng: np.random.RandomState, max_tokens: int, short_prob: float) -> int:
    if rng.random_sample() < short_prob:
        return int(rng.randint(2, max_tokens + 1))
    return max_tokens


def trim_pair(a: list, b: list, max_tokens: int, rng: np.random.RandomState) -> None:
    """Drop tokens from a random end of the longer segment until len(a) + len(b) <= max."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random_sample() < 0.5 else -1]


def build_sample(
    sentences: list[np.ndarray],
    target: int,
    opts: BertOptions,
    tok: BertTokens,
    rng: np.random.RandomState,
) -> dict[str, np.ndarray]:
    """One training sample from a run of sentences (see the module docstring)."""
    is_random = 0
    if opts.binary_head:
        cut = int(rng.randint(1, len(sentences)))  # sentences in A: 1 .. n-1
        a = [int(t) for s in sentences[:cut] for t in s]
        b = [int(t) for s in sentences[cut:] for t in s]
        if rng.random_sample() < 0.5:
            a, b, is_random = b, a, 1
    else:
        a, b = [int(t) for s in sentences for t in s], []
    trim_pair(a, b, target, rng)
    tokens = [tok.cls, *a, tok.sep] + ([*b, tok.sep] if opts.binary_head else [])
    types = [0] * (len(a) + 2) + [1] * (len(tokens) - len(a) - 2)
    tokens = np.asarray(tokens, dtype=np.int64)
    labels, loss_mask = mask_tokens(tokens, opts, tok, rng)
    n, s = len(tokens), opts.seq_length
    out = {
        "text": np.full(s, tok.pad, dtype=np.int64),
        "types": np.zeros(s, dtype=np.int64),
        "labels": np.zeros(s, dtype=np.int64),
        "loss_mask": np.zeros(s, dtype=np.float32),
        "padding_mask": np.zeros(s, dtype=np.int64),
        "is_random": np.int64(is_random),
    }
    out["text"][:n], out["types"][:n], out["labels"][:n] = tokens, types, labels
    out["loss_mask"][:n], out["padding_mask"][:n] = loss_mask, 1
    return out


def mask_tokens(
    tokens: np.ndarray, opts: BertOptions, tok: BertTokens, rng: np.random.RandomState
) -> tuple[np.ndarray, np.ndarray]:
    """Masks `tokens` in place; returns (labels = the original ids, loss mask of the chosen)."""
    labels = tokens.copy()
    candidates = np.flatnonzero((tokens != tok.cls) & (tokens != tok.sep))
    words = [[int(i)] for i in candidates]
    if opts.whole_word_masking and tok.continuation is not None and words:
        words = [words[0]]
        for i in candidates[1:]:
            if tok.continuation[tokens[i]] and words[-1][-1] == i - 1:
                words[-1].append(int(i))
            else:
                words.append([int(i)])
    wanted = min(opts.max_predictions, max(1, int(round(len(tokens) * opts.mask_prob))))
    chosen: list[int] = []
    for w in rng.permutation(len(words)):
        if len(chosen) >= wanted:
            break
        if len(chosen) + len(words[w]) <= wanted:
            chosen += words[w]
    loss_mask = np.zeros(len(tokens), dtype=np.float32)
    for i in chosen:
        r = rng.random_sample()
        if r < 0.8:
            tokens[i] = tok.mask
        elif r >= 0.9:
            tokens[i] = rng.randint(0, tok.vocab_size)
        loss_mask[i] = 1.0
    return labels, loss_mask


class BertDataset(torch.utils.data.Dataset):
    """BERT samples from documents [doc_range) of a sentence-level indexed dataset."""

    def __init__(
        self,
        name: str,
        indexed,
        doc_range: range,
        num_samples: int,
        seed: int,
        opts: BertOptions,
        tokens: BertTokens,
        *,
        cache_dir: str | None = None,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
    ):
        check_sentence_level(indexed, name)
        if len(doc_range) == 0:
            raise DataError(f"{indexed.prefix}: the {name} split has no documents; adjust --split")
        self.name, self.indexed, self.seed = name, indexed, seed
        self.opts, self.tokens = opts, tokens
        description = {
            "name": f"bert-{name}",
            "version": INDEX_VERSION,
            "prefix": os.path.abspath(indexed.prefix),
            "sequences": len(indexed),
            "documents": [doc_range.start, doc_range.stop],
            "num_samples": int(num_samples),
            "seq_length": opts.seq_length,
            "short_seq_prob": opts.short_seq_prob,
            "binary_head": opts.binary_head,
            "seed": seed,
        }
        sizes, doc_idx = indexed.sizes, np.asarray(indexed.doc_idx)
        cache_dir = cache_dir or os.path.join(
            os.path.dirname(os.path.abspath(indexed.prefix)), "index-cache"
        )
        self.samples = cached_indices(
            description,
            lambda: {"samples": build_samples(sizes, doc_idx, doc_range, num_samples, opts, seed)},
            cache_dir,
            is_builder=is_builder,
            barrier=barrier,
            names=("samples",),
        )["samples"]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        first, end, target = (int(x) for x in self.samples[i])
        sentences = [self.indexed.get(s) for s in range(first, end)]
        rng = np.random.RandomState((self.seed + i) % 2**32)
        sample = build_sample(sentences, target, self.opts, self.tokens, rng)
        if int(sample["text"].max()) >= self.tokens.vocab_size:
            raise DataError(
                f"{self.indexed.prefix}: a token id of {self.name} sample {i} is outside the "
                f"vocab [0, {self.tokens.vocab_size}); the data was made with another tokenizer"
            )
        return sample
