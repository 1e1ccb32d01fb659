"""GPT samples over an mmap dataset: Megatron's doc / sample / shuffle indices, cached as .npy.

A sample is `seq_length + 1` consecutive tokens of the shuffled document stream (consecutive
samples share one boundary token); tokens = text[:-1], labels = text[1:].
- doc_idx: the split's documents once per epoch, shuffled (the last, partial epoch separately
  when it would otherwise be over-represented).
- sample_idx (num_samples + 1, 2): (position in doc_idx, token offset) where each sample starts.
- shuffle_idx: a seeded permutation of the samples.
All three are built with vectorized numpy, by one rank, and cached under a name hashed from
everything that determines them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable

import numpy as np
import torch

from megatron.data.indexed_dataset import MMapIndexedDataset

INDEX_VERSION = 1  # bump when the index construction changes: old caches are then ignored


class DataError(ValueError):
    """Data that cannot be trained on (e.g. token ids outside the model's vocab).

    Raised in a DataLoader worker, it comes back re-made as DataError("Caught DataError in
    DataLoader worker process 0.\nOriginal Traceback ... DataError: MESSAGE"): only MESSAGE
    is kept, so the run still ends with one line naming the file."""

    def __init__(self, message: str = ""):
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            where = message.split("\n", 1)[0].removeprefix("Caught DataError ").rstrip(".")
            original = message.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1]
            message = f"{original} ({where})"
        super().__init__(message)


def split_document_ranges(num_documents: int, weights: list[float]) -> list[range]:
    """Normalized split weights -> contiguous train/valid/test document ranges (Megatron's rule)."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [range(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The fewest whole passes over the tokens that yield `num_samples` samples."""
    if tokens_per_epoch < 1:
        raise DataError("the split has no tokens; use more data or change --split")
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def separate_last_epoch(
    tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int
) -> bool:
    """Shuffle the last epoch on its own when less than 80% of it is needed."""
    if num_epochs == 1:
        return False
    from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    needed_from_last = num_samples - from_full_epochs
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return needed_from_last < int(0.80 * per_epoch)


def build_doc_idx(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool
) -> np.ndarray:
    if not separate_last or num_epochs == 1:
        doc_idx = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate([first, last])


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """Where each sample starts: global token position i * seq_length -> (doc_idx pos, offset)."""
    doc_lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(doc_lengths)  # exclusive end position of each doc in the token stream
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    which = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[which] - doc_lengths[which])
    dtype = np.int32 if max(len(doc_idx), int(sizes.max(initial=0))) < 2**31 else np.int64
    return np.stack([which, offsets], axis=1).astype(dtype)


def build_shuffle_idx(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffle [0, num_samples) and [num_samples, total) separately, then concatenate."""
    dtype = np.int32 if total < 2**31 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, epochs)
    rng = np.random.RandomState(seed)
    doc_idx = build_doc_idx(documents, epochs, rng, separate)
    available = (epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, available)
    if separate:
        first = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        shuffle_idx = build_shuffle_idx(first, available, rng)
    else:
        shuffle_idx = build_shuffle_idx(available, available, rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def cached_indices(
    description: dict,
    build: Callable[[], dict[str, np.ndarray]],
    cache_dir: str,
    *,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
    names: tuple[str, ...] = ("doc_idx", "sample_idx", "shuffle_idx"),
):
    """Load the indices named by hash(description) from cache_dir, building them once.

    Only `is_builder` ranks build (atomically: temp file + rename); everyone waits at `barrier`,
    then maps the files read-only.
    """
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    base = os.path.join(cache_dir, f"{digest}-{description['name']}")
    paths = {n: f"{base}-{n}.npy" for n in names}
    if is_builder and not all(os.path.exists(p) for p in paths.values()):
        os.makedirs(cache_dir, exist_ok=True)
        arrays = build()
        for n, p in paths.items():
            tmp = f"{p}.tmp-{os.getpid()}.npy"
            np.save(tmp, arrays[n], allow_pickle=False)
            os.replace(tmp, p)
        with open(f"{base}-description.json", "w") as f:
            json.dump(description, f, indent=2, sort_keys=True)
    if barrier is not None:
        barrier()
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(
            f"{missing[0]}: cached index not found after the building rank finished; put "
            "--data-cache-path on a filesystem every node shares"
        )
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length + 1` tokens from documents [doc_range) of an indexed dataset
    (MMapIndexedDataset, or LegacyIndexedDataset for --data-impl lazy/cached)."""

    def __init__(
        self,
        name: str,
        indexed: MMapIndexedDataset,
        doc_range: range,
        num_samples: int,
        seq_length: int,
        seed: int,
        *,
        cache_dir: str | None = None,
        vocab_size: int | None = None,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
    ):
        if len(doc_range) == 0:
            raise DataError(
                f"{indexed.prefix}: the {name} split has no documents; "
                "adjust --split or give this split its own data path"
            )
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        self.vocab_size = vocab_size
        documents = np.arange(doc_range.start, doc_range.stop, dtype=np.int32)
        description = {
            **self.describe(name),
            "prefix": os.path.abspath(indexed.prefix),
            "sequences": len(indexed),
            "documents": [doc_range.start, doc_range.stop],
            "num_samples": int(num_samples),
            "seq_length": seq_length,
            "seed": seed,
        }
        pair = getattr(indexed, "pair", None)
        if pair and pair.get("pair_id"):  # a rebuilt dataset never reuses the old one's indices
            description["pair_id"] = pair["pair_id"]
        # Each sequence index in doc_idx is a document here (one sequence per document).
        sizes = indexed.sizes
        cache_dir = cache_dir or os.path.join(
            os.path.dirname(os.path.abspath(indexed.prefix)), "index-cache"
        )
        idx = cached_indices(
            description,
            lambda: self.build(sizes, documents, num_samples, seq_length, seed),
            cache_dir,
            is_builder=is_builder,
            barrier=barrier,
            names=self.INDEX_NAMES,
        )
        for n in self.INDEX_NAMES:
            setattr(self, n, idx[n])

    INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")

    def describe(self, name: str) -> dict:
        """What names this kind of index in its cache (besides the data and the sizes)."""
        return {"name": name, "version": INDEX_VERSION}

    def build(self, sizes, documents, num_samples: int, seq_length: int, seed: int) -> dict:
        """The indices INDEX_NAMES of `documents` (cached by the caller)."""
        return build_indices(sizes, documents, num_samples, seq_length, seed)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(self.shuffle_idx[i])
        (d0, o0), (d1, o1) = self.sample_idx[i], self.sample_idx[i + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        if d0 == d1:
            text = self.indexed.get(int(self.doc_idx[d0]), o0, o1 - o0 + 1)
        else:
            parts = [self.indexed.get(int(self.doc_idx[d0]), o0)]
            parts += [self.indexed.get(int(self.doc_idx[d])) for d in range(d0 + 1, d1)]
            parts.append(self.indexed.get(int(self.doc_idx[d1]), 0, o1 + 1))
            text = np.concatenate(parts)
        text = text.astype(np.int64)
        self._check_vocab(text, i)
        return {"text": text}

    def _check_vocab(self, text: np.ndarray, sample: int) -> None:
        if self.vocab_size is None or text.size == 0:
            return
        lo, hi = int(text.min()), int(text.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = hi if hi >= self.vocab_size else lo
            raise DataError(
                f"{self.indexed.prefix}: token id {bad} in {self.name} sample {sample} is outside "
                f"the model's vocab [0, {self.vocab_size}); the data was made with another "
                "tokenizer than --tokenizer-type/--vocab-file (or --vocab-size is too small)"
            )
