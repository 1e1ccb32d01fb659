"""A tiktoken engine for GPT-2 byte-level BPE: the same ids, about 3x faster than HF on a core.

tiktoken merges the adjacent pair whose concatenation has the lowest rank. Giving each merge
result the rank 256 + (its line in merges.txt), and each byte its value, makes that the same
priority order as merges.txt; a lookup table then turns ranks into the vocab's ids, so any
vocab.json/merges.txt pair works, whatever order its ids are in. GPT2BPETokenizer still checks
its first batch against HF tokenizers and falls back to HF on any difference.
"""

from __future__ import annotations

import itertools

import numpy as np

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of vocab.json)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class TiktokenBPE:
    """Batch encoder over tiktoken; `encode_arrays(texts)` -> (flat ids, length of each text)."""

    def __init__(self, encoding, rank_to_id: np.ndarray):
        self._enc, self._lut = encoding, rank_to_id

    @classmethod
    def build(cls, vocab: dict[str, int], merges: list[tuple[str, str]]) -> TiktokenBPE | None:
        """None when tiktoken is missing or the vocab is not a complete byte-level BPE."""
        try:
            import tiktoken
        except ImportError:
            return None
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        ranks: dict[bytes, int] = {}
        rank_to_id: list[int] = []
        for b, ch in bytes_to_unicode().items():
            if ch not in vocab:
                return None
            ranks[bytes([b])] = b
            rank_to_id.append(vocab[ch])
        for left, right in merges:
            token = left + right
            if token not in vocab or any(c not in byte_of for c in token):
                return None
            key = bytes(byte_of[c] for c in token)
            if key not in ranks:  # a repeated merge result keeps its first (highest) priority
                ranks[key] = len(rank_to_id)
                rank_to_id.append(vocab[token])
        try:
            enc = tiktoken.Encoding(
                "megatron-gpt2-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
            )
        except Exception:  # an exotic vocab tiktoken will not take: HF handles it
            return None
        return cls(enc, np.asarray(rank_to_id, dtype=np.int64))

    def encode_arrays(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        docs = self._enc.encode_ordinary_batch(texts, num_threads=1)
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(
            itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lengths.sum())
        )
        return self._lut[flat], lengths
