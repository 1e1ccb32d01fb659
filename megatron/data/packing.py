"""--sequence-packing first-fit: whole documents packed into sequences, padding only the tail.

Concatenate-and-split (`concat`, gpt_dataset.py, the default) cuts the shuffled document stream
every seq_length tokens, so most documents are split across samples. `first-fit` places whole
documents into sequences of seq_length + 1 tokens (tokens = text[:-1], labels = text[1:], so a
document of exactly seq_length + 1 tokens fits):
- each epoch shuffles the split's documents (RandomState(seed), one permutation per epoch);
- the stream is cut into windows of PACK_WINDOW documents; within a window the pieces are
  placed first-fit decreasing (longest first, each into the first open sequence with room,
  else a new one); a window's sequences close with it, in the order they were opened;
- a document longer than the sequence is split by one stated rule: into pieces of
  seq_length + 1 tokens overlapping by one token (the cut of concatenate-and-split), the last
  piece the remainder, each packed as a document of its own; so every next-token label inside
  the document is trained once, and no shorter document is ever split;
- the sequences of each epoch are shuffled among themselves (epochs stay in order, so a short
  last epoch is not over-represented).
The layout is cached as .npy (pieces: (document, offset, length) in sequence order; bins: where
each sequence's pieces start; shuffle_idx), named by a hash of everything that determines it,
like the concat indices: deterministic per seed, and a resume at any iteration reads the same
samples (the sampler skips the consumed ones).

A sample is {"text" (seq_length + 1,), and for its seq_length input tokens "document_ids"
(its pieces 0, 1, ..., the tail padding seq_length, by which the log line's padding fraction
counts it: models/gpt/train.py), "position_ids" (restarting at each piece,
as --reset-position-ids), "loss_mask" (0 on a piece's last token, whose label would be the
next document's first, and on the padding)}. The model attends within documents by cu_seqlens
(model/attention/varlen.py); the padding's id is PAD_ID and its loss is masked.
"""

from __future__ import annotations

import numpy as np

from megatron.data.gpt_dataset import GPTDataset

PACK_WINDOW = 1024  # documents per first-fit window: more packs tighter, builds slower
PACK_VERSION = 1  # bump when the packing changes: old caches are then ignored
PAD_ID = 0  # the token id of the tail padding (its loss is masked; attention keeps it apart)


def document_pieces(documents: np.ndarray, sizes: np.ndarray, seq_length: int) -> np.ndarray:
    """(pieces, 3) int64 rows (document, offset, length): one per document that fits in
    seq_length + 1 tokens, and pieces of seq_length + 1 tokens overlapping by one (the last the
    remainder) of each longer one."""
    documents = documents[sizes[documents] > 0]  # an empty document has nothing to pack
    lengths = sizes[documents].astype(np.int64)
    count = np.maximum(1, -(-(lengths - 1) // seq_length))  # pieces per document
    doc = np.repeat(documents.astype(np.int64), count)
    first = np.repeat(np.cumsum(count) - count, count)
    offset = (np.arange(len(doc)) - first) * seq_length
    length = np.minimum(seq_length + 1, np.repeat(lengths, count) - offset)
    return np.stack([doc, offset, length], axis=1)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """The indices of `lengths` (each <= capacity) placed into bins of `capacity`: longest
    first, each into the first bin with room; bins in the order they were opened."""
    room = np.empty(len(lengths), dtype=np.int64)
    bins: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(room[: len(bins)] >= lengths[i])
        if len(fits):
            bins[fits[0]].append(int(i))
            room[fits[0]] -= lengths[i]
        else:
            room[len(bins)] = capacity - lengths[i]
            bins.append([int(i)])
    return bins


def pack_epoch(pieces: np.ndarray, capacity: int, window: int = PACK_WINDOW) -> list[np.ndarray]:
    """One epoch's pieces (in stream order) -> its sequences, each an array of piece rows."""
    out = []
    for start in range(0, len(pieces), window):
        chunk = pieces[start : start + window]
        out += [chunk[b] for b in first_fit_decreasing(chunk[:, 2], capacity)]
    return out


def build_packed_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """Whole epochs of packed sequences until there are `num_samples`; see the module doc."""
    rng = np.random.RandomState(seed)
    sequences, shuffle = [], []
    while len(sequences) < num_samples:
        order = rng.permutation(documents).astype(np.int64)
        epoch = pack_epoch(document_pieces(order, sizes, seq_length), seq_length + 1)
        if not epoch or not sum(len(p) for p in epoch):
            break
        shuffle.append(len(sequences) + rng.permutation(len(epoch)))
        sequences += epoch
    bins = np.cumsum([0] + [len(s) for s in sequences], dtype=np.int64)
    return {
        "pieces": np.concatenate(sequences) if sequences else np.zeros((0, 3), np.int64),
        "bins": bins,
        "shuffle_idx": np.concatenate(shuffle) if shuffle else np.zeros(0, np.int64),
    }


def packed_fields(lengths, seq_length: int) -> dict[str, np.ndarray]:
    """The per-token fields of a sequence whose pieces have these lengths (in order), for its
    seq_length input tokens: document ids, positions restarting per piece, the loss mask."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pad = seq_length + 1 - int(lengths.sum())
    runs = np.append(lengths, pad) if pad else lengths
    ids = np.repeat(np.arange(len(runs)), runs)
    ids[ids == len(lengths)] = seq_length  # the padding's: the model's log counts it
    starts = np.repeat(np.cumsum(runs) - runs, runs)
    positions = np.arange(seq_length + 1) - starts
    last = positions == np.repeat(runs - 1, runs)  # a piece's last token: its label crosses
    keep = ~last & (ids < len(lengths))
    return {
        "document_ids": ids[:seq_length],
        "position_ids": positions[:seq_length],
        "loss_mask": keep[:seq_length].astype(np.float32),
    }


class PackedGPTDataset(GPTDataset):
    """Whole documents of documents [doc_range) packed first-fit into samples of
    seq_length + 1 tokens (the module doc); GPTDataset's arguments, and the same checks."""

    INDEX_NAMES = ("pieces", "bins", "shuffle_idx")

    def __init__(self, name: str, indexed, *args, is_builder: bool = True, **kwargs):
        super().__init__(name, indexed, *args, is_builder=is_builder, **kwargs)
        if is_builder:
            print(f" {self.summary()}", flush=True)

    def describe(self, name: str) -> dict:
        return {
            "name": f"{name}-packed",
            "version": PACK_VERSION,
            "packing": "first-fit",
            "window": PACK_WINDOW,
        }

    def build(self, sizes, documents, num_samples: int, seq_length: int, seed: int) -> dict:
        return build_packed_indices(sizes, documents, num_samples, seq_length, seed)

    def padding_fraction(self) -> float:
        """The share of the samples' tokens that are tail padding."""
        total = (len(self.bins) - 1) * (self.seq_length + 1)
        return 1.0 - float(self.pieces[:, 2].sum()) / total if total else 0.0

    def summary(self) -> str:
        """The dataset build summary's line."""
        split = int((self.pieces[:, 1] > 0).sum())
        return (
            f"{self.name} split packed first-fit (window {PACK_WINDOW} documents): "
            f"{len(self.bins) - 1} sequences of {self.seq_length + 1} tokens from "
            f"{len(self.pieces) - split} documents and {split} more pieces of those longer "
            f"than the sequence, padding {100 * self.padding_fraction():.2f}% of the tokens"
        )

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        j = int(self.shuffle_idx[i])
        rows = self.pieces[int(self.bins[j]) : int(self.bins[j + 1])]
        parts = [self.indexed.get(int(d), int(o), int(n)) for d, o, n in rows]
        text = np.concatenate(parts).astype(np.int64)
        self._check_vocab(text, j)
        pad = self.seq_length + 1 - len(text)
        sample = {"text": np.pad(text, (0, pad), constant_values=PAD_ID)}
        sample.update(packed_fields(rows[:, 2], self.seq_length))
        return sample
