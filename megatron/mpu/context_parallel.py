"""Context parallelism: each sequence split over the CP group, attention as a ring.

The load-balanced split: a sequence of s tokens is cut into 2 x CP chunks of c = s / (2 CP);
CP rank r holds chunks r and 2 CP - 1 - r, side by side, (b, 2c, ...). Under a causal mask a
query in chunk i attends to chunks <= i, so every rank gets one "early" and one "late" chunk
and the same amount of attention work.

Ring attention, over the CP group: forward: each rank starts with its own K/V, then CP - 1
times sends the K/V block in hand to the next rank while it attends to it (async
batch_isend_irecv overlapped with the block's math); the per-block results are merged exactly
by their log-sum-exp. backward: the K/V blocks go round again, and with each one the gradient
of its K/V accumulated by the ranks it visited, so after CP steps every rank holds the full
dK/dV of its own block.

Within a step the two query chunks meet the two key chunks: chunk ids qi > kj attend fully,
qi == kj causally (the diagonal), qi < kj not at all (skipped). With documents
(--reset-attention-mask, mpu/ring_documents.py) a pair may also be skipped (no document in
common) or masked: with fused blocks its dense pieces (a rectangle, or a causal square per
document) through the fused kernel (mpu/ring_pieces.py), else the explicit math with the
block's keep mask.

Each block is computed by mpu/ring_blocks.py: PyTorch's fused SDPA kernels that return the LSE
(flash / memory-efficient on CUDA, the flash kernel for CPU) where the device and dtype have one
(`--attention-backend sdpa`, the default), else (or with `--attention-backend unfused`) explicit
fp32 matmul + softmax. Merges and the dQ / dK / dV sums are fp32 either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.mpu import ring_pieces
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.ring_blocks import BACKENDS, MATH, block_step, select_blocks
from megatron.mpu.ring_documents import BlockKind, RingDocuments, causal_kind
from megatron.mpu.utils import divide

# ---- the load-balanced split ----


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of 2 x CP sequence chunks CP rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def context_parallel_slice(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1):
    """This CP rank's chunks r and 2 CP - 1 - r of `x` along `dim` (s -> 2 s / (2 CP)).
    Raises ValueError when 2 x CP does not divide the sequence."""
    if cp_size == 1:
        return x
    chunk = divide(x.size(dim), 2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat(
        [x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)], dim
    )


def context_parallel_unslice(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of context_parallel_slice: every CP rank's slice, in rank order -> the sequence."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def context_parallel_positions(batch: int, seq_length: int, cp_rank: int, cp_size: int, device):
    """(b, 2 s / (2 CP)) global positions of this rank's tokens (for position embeddings, RoPE)."""
    positions = torch.arange(seq_length, device=device).expand(batch, seq_length)
    return context_parallel_slice(positions, cp_rank, cp_size)


def gather_documents(document_ids: torch.Tensor, state: ParallelState) -> RingDocuments:
    """This CP rank's tokens' document ids (b, 2c) -> the RingDocuments of the whole sequences
    (one all-gather of b x s integers over the CP group)."""
    local = document_ids.contiguous()
    parts = [torch.empty_like(local) for _ in range(state.cp_size)]
    dist.all_gather(parts, local, group=state.cp_group)
    return RingDocuments.from_sequence(context_parallel_unslice(parts), state.cp_size)


# ---- merging blocks ----


def _merge(out, lse, block_out, block_lse):
    """Two partial softmax-attentions of the same queries over disjoint keys -> their union.
    A row that saw no key in either (LSE -inf in both: documents) stays out 0, LSE -inf."""
    new = torch.logaddexp(lse, block_lse)
    base = new.masked_fill(new == float("-inf"), 0.0)  # exp(-inf - 0) = 0, not NaN
    weight, block_weight = torch.exp(lse - base), torch.exp(block_lse - base)
    return out * weight.unsqueeze(-1) + block_out * block_weight.unsqueeze(-1), new


# ---- the ring ----


@dataclass(frozen=True)
class _Ring:
    group: object
    rank: int  # in the CP group
    size: int
    next: int  # global ranks of the neighbours
    prev: int

    def exchange(self, send: torch.Tensor, tag: int):
        """Start sending `send` to the next rank and receiving its like from the previous one;
        returns (the receive buffer, the requests to wait for)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    def pairs(self, step: int, documents: RingDocuments | None, piecewise: bool):
        """(query half, key half, mask, causal) to compute at `step`, with K/V from
        rank - step; skipped pairs (keys in the future, no document in common) are left out.
        mask: None (unmasked), or for a masked pair its pieces (`piecewise`, see
        masked_block) or keep mask."""
        src = (self.rank - step) % self.size
        q_ids, k_ids = chunk_ids(self.rank, self.size), chunk_ids(src, self.size)
        for qi, q_chunk in enumerate(q_ids):
            for kj, k_chunk in enumerate(k_ids):
                if documents is None:
                    kind = causal_kind(q_chunk, k_chunk)
                else:
                    kind = documents.kind(q_chunk, k_chunk)
                if kind is BlockKind.SKIP:
                    continue
                mask = None
                if kind is BlockKind.MASKED:
                    mask = masked_block(documents, q_chunk, k_chunk, piecewise)
                yield qi, kj, mask, kind is BlockKind.CAUSAL


_KV_TAG, _DKV_TAG = 271, 272


def _wait(requests) -> None:
    for r in requests:
        r.wait()


def _expand(kv: torch.Tensor, q_per_group: int) -> torch.Tensor:
    """(b, g, s, d) key/value heads -> (b, g q_per_group, s, d), each serving its queries."""
    return kv.repeat_interleave(q_per_group, dim=1) if q_per_group > 1 else kv


def _fold(dkv: torch.Tensor, q_per_group: int) -> torch.Tensor:
    """Inverse of _expand for gradients: sum over the queries of each group."""
    if q_per_group == 1:
        return dkv
    b, h, s, d = dkv.shape
    return dkv.view(b, h // q_per_group, q_per_group, s, d).sum(2)


def _block_settings(q, k, blocks, scale):
    """(softmax scale, queries per key/value head, the dtype the blocks compute in)."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return scale, q.size(1) // k.size(1), blocks.dtype(q.dtype)


def masked_block(documents: RingDocuments, q_chunk: int, k_chunk: int, piecewise: bool):
    """How a MASKED pair runs: its pieces through the fused kernel (piecewise, and ids that
    are contiguous runs), else its (b, 1, c, c) keep mask through the fp32 math."""
    pieces = documents.pieces(q_chunk, k_chunk) if piecewise else None
    return documents.keep(q_chunk, k_chunk) if pieces is None else pieces


def _block_forward(blocks, q, k, v, scale, causal, p, mask):
    """One block through `blocks`; a masked one by pieces (a tuple) or through the fp32 math
    with its keep mask (a tensor)."""
    if mask is None:
        return block_step(blocks, q, k, v, scale, causal, p)
    if isinstance(mask, tuple):
        return ring_pieces.forward(blocks, q, k, v, scale, p, mask)
    return block_step(MATH, q.float(), k.float(), v.float(), scale, causal, p, mask)


def _block_backward(blocks, q, k, v, dout, out, lse, scale, causal, p, replay, mask):
    """(dq, dk, dv) of one block, through what ran its forward."""
    if mask is None:
        return blocks.backward(q, k, v, dout, out, lse, scale, causal, p, replay)
    if isinstance(mask, tuple):
        return ring_pieces.backward(blocks, q, k, v, dout, out, lse, scale, p, replay, mask)
    q, k, v, dout, out = (t.float() for t in (q, k, v, dout, out))
    return MATH.backward(q, k, v, dout, out, lse, scale, causal, p, replay, keep=mask)


class _RingAttention(torch.autograd.Function):
    """Forward: causal softmax(q k^T / sqrt(d)) v of this rank's queries over the whole
    sequence, K/V passed round the CP ring (within documents, given `documents`). Backward: dQ
    here, dK/dV ringed back home."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, p: float, blocks, documents, piecewise: bool, scale):
        # q: (b, h, 2c, d); k, v: (b, g, 2c, d), this rank's chunks; the blocks run in
        # blocks.dtype (fp32 for the math, the model dtype for fused kernels), merges in fp32
        scale, qpg, dtype = _block_settings(q, k, blocks, scale)
        qs = q.to(dtype).chunk(2, dim=2)  # the two query chunks, (b, h, c, d) each
        out, lse, replays = [None, None], [None, None], []
        kv = torch.stack([k, v])  # (2, b, g, 2c, d) in the model dtype: one message per step
        for step in range(ring.size):
            if step < ring.size - 1:
                kv_next, requests = ring.exchange(kv, _KV_TAG)  # overlaps this step's math
            ks, vs = (_expand(t.to(dtype), qpg).chunk(2, dim=2) for t in kv)
            for qi, kj, mask, causal in ring.pairs(step, documents, piecewise):
                o, s, replay = _block_forward(
                    blocks, qs[qi], ks[kj], vs[kj], scale, causal, p, mask
                )
                replays.append(replay)  # dropout's replay (generator state or philox seed)
                o = o.float()
                out[qi], lse[qi] = (o, s) if out[qi] is None else _merge(out[qi], lse[qi], o, s)
            if step < ring.size - 1:
                _wait(requests)
                kv = kv_next
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)  # (b, h, 2c, d), (b, h, 2c)
        result = out.to(q.dtype)
        # what the blocks' backward reads: the fp32 output for the math, the returned one
        # (model dtype, no extra copy) for fused kernels
        ctx.save_for_backward(q, k, v, out if dtype == torch.float32 else result, lse)
        ctx.ring, ctx.p, ctx.blocks, ctx.replays = ring, p, blocks, replays
        ctx.documents, ctx.piecewise, ctx.scale = documents, piecewise, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, p, blocks, replays = ctx.ring, ctx.p, ctx.blocks, iter(ctx.replays)
        documents, piecewise = ctx.documents, ctx.piecewise
        scale, qpg, dtype = _block_settings(q, k, blocks, ctx.scale)
        qs, dos = q.to(dtype).chunk(2, dim=2), dout.to(dtype).contiguous().chunk(2, dim=2)
        outs, lses = out.to(dtype).chunk(2, dim=2), lse.chunk(2, dim=2)
        lses = [t.contiguous() for t in lses]  # the kernels index LSE rows densely
        dq = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in qs]
        kv = torch.stack([k, v])
        dkv_in = dkv_requests = None  # dK/dV travel in fp32: they are sums over the ring
        for step in range(ring.size):
            if step < ring.size - 1:
                kv_next, kv_requests = ring.exchange(kv, _KV_TAG)
            ks, vs = (_expand(t.to(dtype), qpg).chunk(2, dim=2) for t in kv)
            dks = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in ks]
            dvs = [torch.zeros_like(t) for t in dks]
            for qi, kj, mask, causal in ring.pairs(step, documents, piecewise):
                dq_b, dk_b, dv_b = _block_backward(
                    blocks, qs[qi], ks[kj], vs[kj], dos[qi], outs[qi], lses[qi], scale, causal,
                    p, next(replays), mask,
                )  # fmt: skip
                dq[qi] += dq_b
                dks[kj] += dk_b
                dvs[kj] += dv_b
            # this step's dK/dV of the block in hand, plus what the ranks before added to it
            dkv = torch.stack([_fold(torch.cat(dks, 2), qpg), _fold(torch.cat(dvs, 2), qpg)])
            if dkv_requests is not None:
                _wait(dkv_requests)
                dkv += dkv_in
            dkv_in, dkv_requests = ring.exchange(dkv, _DKV_TAG)  # on to the next rank
            if step < ring.size - 1:
                _wait(kv_requests)
                kv = kv_next
        _wait(dkv_requests)  # after CP steps the block's gradient is back home
        dk, dv = dkv_in.to(k.dtype).unbind(0)
        return torch.cat(dq, dim=2).to(q.dtype), dk, dv, None, None, None, None, None, None


class RingAttention:
    """Causal attention over the sequence split across `state`'s CP group (see the module
    docstring). q: (b, heads, 2c, d); k, v: (b, groups, 2c, d), this rank's load-balanced chunks;
    heads / groups queries share each key/value head (GQA). Returns (b, heads, 2c, d).

    `backend` (mpu/ring_blocks.py): "auto" runs each block through a fused SDPA kernel that
    returns the LSE where the device and dtype have one (chosen on the first call), else the
    explicit fp32 math; "fused" insists on the kernel; "math" is the explicit math.

    `documents` (mpu/ring_documents.py, from gather_documents): causal attention within each
    token's own document (--reset-attention-mask); pairs of chunks with no document in common
    are skipped, partly masked ones run piecewise through the fused kernel (its dense
    rectangle or causal squares per sample, mpu/ring_pieces.py) where the blocks are fused,
    else (or with `piecewise_documents=False`: the benchmark's baseline) the explicit fp32
    math with their mask; the rest run as without documents.

    Dropout (`dropout_p`) draws its masks from the current default generator, as F.dropout
    would (callers fork the RNG tracker around it), and backward replays them. Where the fused
    kernel has no dropout (the CPU's), calls with dropout_p > 0 run the math."""

    def __init__(
        self, state: ParallelState, backend: str = "auto", piecewise_documents: bool = True
    ):
        if state.cp_size < 2:
            raise ValueError("ring attention needs a context-parallel group of 2 or more ranks")
        ranks, r = state.cp_ranks, state.cp_rank
        self.ring = _Ring(
            state.cp_group, r, state.cp_size, ranks[(r + 1) % len(ranks)], ranks[r - 1]
        )
        if backend not in BACKENDS:
            raise ValueError(f"ring attention backend {backend!r}: expected one of {BACKENDS}")
        self.backend = backend
        self.piecewise_documents = piecewise_documents

    def blocks(self, q: torch.Tensor, dropout_p: float = 0.0):
        """The block implementation calls with these queries use."""
        blocks = select_blocks(self.backend, q.device, q.dtype, q.size(-1))
        return blocks if blocks.dropout or dropout_p == 0.0 else MATH

    def __call__(
        self,
        q,
        k,
        v,
        dropout_p: float = 0.0,
        documents: RingDocuments | None = None,
        scale: float | None = None,
    ):
        """`scale`: of the scores (default 1 / sqrt(q's head size)). Values may have another
        head size than queries and keys (multi-latent attention): the narrower side is padded
        with zeros, which changes no score and no output, and the output cut back."""
        dv, dqk = v.size(-1), q.size(-1)
        if dv != dqk:
            scale = 1.0 / math.sqrt(dqk) if scale is None else scale
            width = max(dv, dqk)
            q, k, v = (F.pad(t, (0, width - t.size(-1))) for t in (q, k, v))
            return self(q, k, v, dropout_p, documents, scale)[..., :dv]
        c = divide(q.size(2), 2)  # two chunks per rank
        divide(q.size(1), k.size(1))
        if documents is not None and documents.chunks.shape[1:] != (q.size(0), c):
            raise ValueError(
                f"document ids for (b, c) = {tuple(documents.chunks.shape[1:])} chunks given "
                f"to ring attention over (b, c) = ({q.size(0)}, {c})"
            )
        p, blocks = float(dropout_p), self.blocks(q, float(dropout_p))
        piecewise = self.piecewise_documents and blocks is not MATH
        return _RingAttention.apply(q, k, v, self.ring, p, blocks, documents, piecewise, scale)
