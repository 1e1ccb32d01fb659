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
    MASKED  anything else. With fused blocks: per sample a few dense pieces (documents are
            contiguous: off the diagonal one rectangle, on it one causal square per document
            segment) through the fused kernel, mpu/ring_pieces.py; with the math blocks (or ids
            that are not contiguous runs) the explicit fp32 math with the block's keep mask.
            A query row with no key allowed in the block gets LSE -inf and adds nothing when
            merged.

A kind holds for the whole micro batch: a pair is FULL (CAUSAL) only if it is in every sample,
SKIP only if it is in every sample; otherwise MASKED, with each sample's own mask.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import torch

from megatron.mpu.ring_pieces import SHORT, TILE, Piece


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
    _pieces: dict = field(default_factory=dict, init=False, repr=False)  # by (q, k) chunk

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

    def pieces(self, q_chunk: int, k_chunk: int) -> tuple[Piece, ...] | None:
        """The dense pieces of a MASKED pair (mpu/ring_pieces.py), each over the samples that
        share its boundaries; None where some sample's ids are not contiguous runs (an id
        that comes back after another), which only the math with keep() handles."""
        key = (q_chunk, k_chunk)
        if key not in self._pieces:
            self._pieces[key] = self._plan(q_chunk, k_chunk)
        return self._pieces[key]

    @cached_property
    def _segments(self) -> list[list[list[tuple[int, int, int]]]] | None:
        """segments[chunk][sample]: the (start, end, id) runs of equal ids of the chunk; None
        unless each id is one run of its sample. Two device-to-host copies, once."""
        n, b, c = self.chunks.shape
        whole = self.chunks.transpose(0, 1).reshape(b, n * c)  # (b, s)
        ordered = whole.sort(1).values
        changes = (whole[:, 1:] != whole[:, :-1]).sum(1)
        if not torch.equal(changes, (ordered[:, 1:] != ordered[:, :-1]).sum(1)):
            return None
        starts = torch.ones_like(self.chunks, dtype=torch.bool)
        starts[..., 1:] = self.chunks[..., 1:] != self.chunks[..., :-1]
        where = torch.cat([starts.nonzero(), self.chunks[starts].unsqueeze(1)], 1).tolist()
        segments = [[[] for _ in range(b)] for _ in range(n)]
        for chunk, sample, start, doc in where:  # in order of chunk, sample, start
            runs = segments[chunk][sample]
            if runs:
                runs[-1] = (runs[-1][0], start, runs[-1][2])
            runs.append((start, c, doc))
        return segments

    def _plan(self, i: int, j: int) -> tuple[Piece, ...] | None:
        if self._segments is None:
            return None
        groups: dict[tuple, list[int]] = {}  # (rows, cols, causal, tile) -> samples
        for sample in range(self.chunks.size(1)):
            if i == j:  # a causal square per document segment, short ones tiled
                for span, tile in _diagonal_spans(self._segments[i][sample]):
                    groups.setdefault((span, span, not tile, tile), []).append(sample)
            elif i > j:  # the one document from the key chunk into the query chunk, if any
                _, r, first = self._segments[i][sample][0]
                c0, c, last = self._segments[j][sample][-1]
                if first == last:
                    groups.setdefault(((0, r), (c0, c), False, False), []).append(sample)
        return tuple(self._piece(i, *key, samples) for key, samples in groups.items())

    def _piece(self, i, rows, cols, causal, tile, samples) -> Piece:
        device, b = self.chunks.device, self.chunks.size(1)
        index = None if len(samples) == b else torch.tensor(samples, device=device)
        keep = None
        if tile:  # (n, 1, L, L): causal within the tile's documents
            ids = self.chunks[i, :, rows[0] : rows[1]]  # (b, L)
            ids = ids if index is None else ids.index_select(0, index)
            keep = ids.unsqueeze(2) == ids.unsqueeze(1)
            keep &= torch.ones(keep.shape[1:], dtype=torch.bool, device=device).tril()
            keep = keep.unsqueeze(1)
        return Piece(index, rows, cols, causal, keep)


def _diagonal_spans(segments) -> list[tuple[tuple[int, int], bool]]:
    """The diagonal's pieces from a chunk's (start, end, id) runs: ((start, end), tile?). A
    segment of SHORT tokens or more is its own causal square; consecutive shorter ones are
    packed into tiles of up to TILE tokens for the math (a tile of one stays a square)."""
    spans, tile = [], []

    def close():
        if tile:
            spans.append(((tile[0][0], tile[-1][1]), len(tile) > 1))
            tile.clear()

    for start, end, _ in segments:
        if end - start >= SHORT:
            close()
            spans.append(((start, end), False))
            continue
        if tile and end - tile[0][0] > TILE:
            close()
        tile.append((start, end))
    close()
    return spans


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
