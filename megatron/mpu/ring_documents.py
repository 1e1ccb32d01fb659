"""Document masks for ring attention: --reset-attention-mask with --context-parallel-size.

A packed sample holds several documents, and a token attends only to earlier tokens of its own
document: keep(i, j) = (pos j <= pos i) and doc(i) == doc(j). Under the load-balanced split
(mpu/context_parallel.py) a rank holds 2 of the sample's 2 x CP chunks and sees every other
chunk's K/V as it passes round the ring. Once per forward the CP ranks all-gather their tokens'
document ids (b x s integers, one collective), so every rank knows the ids of every chunk and a
K/V block needs no ids of its own on the ring. From them each (query chunk i, key chunk j) pair
of the sample is one of:

    SKIP    no query sees a key: j > i (the keys are in the future), or no document in common.
            Not computed, forward or backward (common with many short documents).
    FULL    j < i and both chunks lie inside one document: every query sees every key; the
            block runs as without documents (the fused kernel where there is one).
    CAUSAL  j == i inside one document: the plain causal diagonal, as without documents.
    MASKED  anything else: the explicit fp32 math with the keep mask of the block. A query row
            with no key allowed in the block gets LSE -inf and adds nothing when merged.

A kind holds for the whole micro batch: a pair is FULL (CAUSAL) only if it is in every sample,
SKIP only if it is in every sample; otherwise MASKED, with each sample's own mask.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class BlockKind(enum.IntEnum):
    SKIP = 0
    FULL = 1
    CAUSAL = 2
    MASKED = 3


def causal_kind(q_chunk: int, k_chunk: int) -> BlockKind:
    """The kind of a pair under the plain causal mask (no documents)."""
    if q_chunk == k_chunk:
        return BlockKind.CAUSAL
    return BlockKind.FULL if q_chunk > k_chunk else BlockKind.SKIP


@dataclass(frozen=True, eq=False)
class RingDocuments:
    """The document ids of a micro batch's sequences, by chunk, and the kind of every pair."""

    chunks: torch.Tensor  # (2 CP, b, c): the document id of each token of each chunk
    kinds: tuple[tuple[BlockKind, ...], ...]  # kinds[query chunk][key chunk]

    @classmethod
    def from_sequence(cls, document_ids: torch.Tensor, cp_size: int) -> RingDocuments:
        """From the whole sequences' ids (b, s), s divisible by 2 x CP."""
        b, s = document_ids.shape
        n = 2 * cp_size
        if s % n:
            raise ValueError(f"{s} tokens do not split into 2 x CP = {n} chunks")
        chunks = document_ids.view(b, n, s // n).transpose(0, 1)  # (2 CP, b, c)
        return cls(chunks, _kinds(chunks))

    @property
    def chunk_length(self) -> int:
        return self.chunks.size(2)

    def kind(self, q_chunk: int, k_chunk: int) -> BlockKind:
        return self.kinds[q_chunk][k_chunk]

    def keep(self, q_chunk: int, k_chunk: int) -> torch.Tensor:
        """(b, 1, c, c) bool, True where query i of chunk q_chunk may see key j of k_chunk
        (broadcast over heads). Built when a MASKED block runs: c x c per block, never the
        whole (s, s)."""
        q, k = self.chunks[q_chunk], self.chunks[k_chunk]  # (b, c) each
        keep = q.unsqueeze(2) == k.unsqueeze(1)  # (b, c, c): same document
        if q_chunk == k_chunk:  # the diagonal: earlier keys only
            keep &= torch.ones(keep.shape[1:], dtype=torch.bool, device=keep.device).tril()
        elif q_chunk < k_chunk:
            keep = torch.zeros_like(keep)
        return keep.unsqueeze(1)


def _single(ids: torch.Tensor) -> torch.Tensor:
    """(b, c) -> (b,): the chunk lies inside one document."""
    return (ids == ids[:, :1]).all(1)


def _kinds(chunks: torch.Tensor) -> tuple[tuple[BlockKind, ...], ...]:
    """The kind of every (query chunk, key chunk) pair; one device-to-host copy."""
    n, b, _ = chunks.shape
    # ids made distinct per sample, so that one isin finds the ids two chunks share per sample
    lowest = chunks.amin()
    offset = (chunks.amax() - lowest + 1) * torch.arange(b, device=chunks.device).unsqueeze(1)
    flat = (chunks - lowest + offset).reshape(n, -1)  # (2 CP, b c)
    single = torch.stack([_single(c) for c in chunks])  # (2 CP, b)
    full = torch.zeros(n, n, dtype=torch.bool, device=chunks.device)
    shared = torch.zeros_like(full)
    for i in range(n):
        shared[i, i] = True  # a token sees itself
        full[i, i] = single[i].all()
        for j in range(i):  # keys all earlier than the queries
            one = single[i] & single[j] & (chunks[i, :, 0] == chunks[j, :, 0])  # (b,)
            full[i, j] = one.all()
            shared[i, j] = torch.isin(flat[i], flat[j]).any()
    full, shared = torch.stack([full, shared]).tolist()
    kinds = [[BlockKind.SKIP] * n for _ in range(n)]
    for i in range(n):
        kinds[i][i] = BlockKind.CAUSAL if full[i][i] else BlockKind.MASKED
        for j in range(i):
            if full[i][j]:
                kinds[i][j] = BlockKind.FULL
            elif shared[i][j]:
                kinds[i][j] = BlockKind.MASKED
    return tuple(tuple(row) for row in kinds)
