"""A masked ring-attention block (documents, mpu/ring_documents.py) through the fused kernels,
piece by piece.

Documents are contiguous runs of tokens, so per sample what a masked block lets a query see is
a few dense sub-blocks ("pieces"), with nothing outside them:

- off the diagonal (the keys' chunk earlier than the queries'): at most one document spans
  from the key chunk into the query chunk, so one rectangle, rows [0, r) x keys [c0, c), every
  pair visible: the fused kernel, not causal;
- on the diagonal: one causal square per document segment of the chunk: the fused kernel,
  causal (the square's queries and keys are the same positions, so top-left is right).

Forward puts each piece's output and LSE into its rows of the block (rows in no piece: out 0,
LSE -inf, as the masked math gives them); backward runs each piece's kernel backward on its rows
of the final out / LSE / dout, its dq going to those rows and its dk / dv to its key columns.
Pieces with the same boundaries in several samples run as one batch. A run of very short
documents on the diagonal (each under SHORT tokens, where a kernel call per document costs more
than the whole run's scores) is one "tile" of up to TILE tokens through the explicit math with
the tile's own keep mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.mpu.ring_blocks import MATH, block_step

SHORT, TILE = 4, 32  # tokens; see bench/context_parallel.py --tables documents


@dataclass(frozen=True, eq=False)
class Piece:
    """Queries rows[0]:rows[1] of a block over its keys cols[0]:cols[1], in the samples
    `index` (a (n,) tensor; None: every sample of the micro batch)."""

    index: torch.Tensor | None
    rows: tuple[int, int]
    cols: tuple[int, int]
    causal: bool
    keep: torch.Tensor | None = None  # (n, 1, rows, cols) bool: a tile through the math

    def take(self, t: torch.Tensor, span: tuple[int, int], dim: int = 2) -> torch.Tensor:
        """This piece's samples and positions `span` of t (b, ...) along `dim` (2: tokens of
        (b, h, c, d); -1: rows of an LSE (b, h, c))."""
        lo, hi = span
        t = t.narrow(dim, lo, hi - lo)
        return t if self.index is None else t.index_select(0, self.index)

    def put(self, t: torch.Tensor, span: tuple[int, int], value: torch.Tensor, dim: int = 2):
        """t[this piece's samples, positions span along dim] = value (pieces' rows are
        disjoint: each row of a block is in one piece at most)."""
        part = t.narrow(dim, span[0], span[1] - span[0])
        if self.index is None:
            part.copy_(value)
        else:
            part.index_copy_(0, self.index, value.to(part.dtype))

    def add(self, t: torch.Tensor, span: tuple[int, int], value: torch.Tensor, dim: int = 2):
        """t[this piece's samples, positions span along dim] += value."""
        part = t.narrow(dim, span[0], span[1] - span[0])
        if self.index is None:
            part.add_(value)
        else:
            part.index_add_(0, self.index, value.to(part.dtype))


def forward(blocks, q, k, v, scale: float, p: float, pieces: tuple[Piece, ...]):
    """The block's (out fp32 (b, h, c, d), lse fp32 (b, h, c), the pieces' replays); q, k, v in
    blocks' dtype, one query chunk over one key chunk."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    replays = []
    for piece in pieces:
        qp = piece.take(q, piece.rows)
        kp, vp = (piece.take(t, piece.cols) for t in (k, v))
        if piece.keep is None:
            o, s, replay = block_step(blocks, qp, kp, vp, scale, piece.causal, p)
        else:
            qp, kp, vp = qp.float(), kp.float(), vp.float()
            o, s, replay = block_step(MATH, qp, kp, vp, scale, False, p, piece.keep)
        replays.append(replay)
        piece.put(out, piece.rows, o.float())
        piece.put(lse, piece.rows, s, dim=-1)
    return out, lse, replays


def backward(blocks, q, k, v, dout, out, lse, scale: float, p: float, replays, pieces):
    """(dq, dk, dv) fp32 of the block given the final out / LSE of its rows (the ring's)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    for piece, replay in zip(pieces, replays, strict=True):
        qp, dop, outp = (piece.take(t, piece.rows) for t in (q, dout, out))
        lsep = piece.take(lse, piece.rows, dim=-1).contiguous()  # kernels index rows densely
        kp, vp = (piece.take(t, piece.cols) for t in (k, v))
        if piece.keep is None:
            grads = blocks.backward(qp, kp, vp, dop, outp, lsep, scale, piece.causal, p, replay)
        else:
            qp, kp, vp, dop, outp = (t.float() for t in (qp, kp, vp, dop, outp))
            grads = MATH.backward(
                qp, kp, vp, dop, outp, lsep, scale, False, p, replay, keep=piece.keep
            )
        piece.add(dq, piece.rows, grads[0].float())
        piece.add(dk, piece.cols, grads[1].float())
        piece.add(dv, piece.cols, grads[2].float())
    return dq, dk, dv
