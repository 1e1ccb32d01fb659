"""The output layer and the vocab-parallel cross-entropy fused over chunks of tokens.

loss_i = logsumexp_v(z_iv) - z_i,t_i with z = X A^T, A = [A_1; ...; A_p] split along the vocab
(rank r holds A_r, (V/p, h)). Tokens go through `rows` at a time, so only a (rows, V/p) block
of logits exists at once: never the (tokens, V/p) logits nor their fp32 copy (at GPT 1.3B,
micro-batch 8 x 2048, those are 1.6 GB and 3.3 GB).

Forward: per chunk z = X_c A_r^T (the input's dtype), padding columns (ids >= the real vocab)
-inf, this rank's log-sum-exp and target logit (fp32); after the last chunk, one all-reduce MAX
and one all-reduce SUM over TP combine the ranks' log-sum-exps. Saved for backward: X and the
log-sum-exp (fp32, one per token).
Backward: per chunk z again, G = (softmax(z) - onehot(t)) * dloss (input dtype),
dX_c = G A_r, dA_r += G^T X_c (fp32 sum). dX then crosses the TP boundary like any
column-parallel input: all-reduce (the caller's copy_to region), or with sequence parallelism a
reduce-scatter along the sequence, X (b, s/p, h) having been all-gathered in forward and
again in backward (as _GatheredLinear does, keeping only the slice between the two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.mpu.cross_entropy import _all_reduce
from megatron.mpu.mappings import all_gather_sequence, reduce_scatter_sequence
from megatron.mpu.utils import group_rank, group_size

# A chunk's logits in fp32 take at most this many bytes (the rows are a multiple of ROW_MULTIPLE,
# so the matmuls stay large): 512 MiB is 2,560 rows at GPT-2's V = 50,304.
CHUNK_BYTES = 512 * 2**20
ROW_MULTIPLE = 128


def chunk_rows(n_tokens: int, local_vocab: int) -> int:
    """Tokens per chunk: as many as fit CHUNK_BYTES of fp32 logits, a multiple of ROW_MULTIPLE."""
    rows = CHUNK_BYTES // (4 * max(local_vocab, 1)) // ROW_MULTIPLE * ROW_MULTIPLE
    return min(max(rows, ROW_MULTIPLE), max(n_tokens, 1))


def local_targets(target: torch.Tensor, vocab_start: int, local_vocab: int):
    """(column of each target in this rank's slice, 0 where elsewhere; whether it is here)."""
    inside = (target >= vocab_start) & (target < vocab_start + local_vocab)
    return (target - vocab_start).masked_fill(~inside, 0), inside


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The math's dtype: fp32, or wider (fp64 inputs stay fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _torch_stats(z: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """(c, V/p) logits -> this rank's log-sum-exp (c,) (-inf where every logit is -inf) and
    target logit (c,) (0 where the target is on another rank), both in fp32 or wider."""
    zf = z.to(_wide(z.dtype))  # (c, V/p): the chunk's fp32 copy
    lse = torch.logsumexp(zf, dim=-1)
    local, inside = local_targets(target, vocab_start, z.size(-1))
    z_t = zf.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    return lse, z_t


def _torch_grad(z, target, vocab_start: int, lse: torch.Tensor, dloss: torch.Tensor):
    """dloss/dz = (softmax(z) - onehot(target)) * dloss, (c, V/p) in z's dtype; `lse` the
    global log-sum-exp (c,)."""
    p = (z.to(lse.dtype) - lse.unsqueeze(-1)).exp_()  # (c, V/p) softmax, fp32
    local, inside = local_targets(target, vocab_start, z.size(-1))
    p.scatter_add_(-1, local.unsqueeze(-1), -inside.to(p.dtype).unsqueeze(-1))
    return p.mul_(dloss.unsqueeze(-1)).to(z.dtype)


class ChunkOps(NamedTuple):
    """The elementwise part on one chunk of logits: `stats` (forward) and `grad` (backward),
    with _torch_stats' and _torch_grad's signatures; megatron.fused_kernels has Triton ones."""

    name: str
    stats: object
    grad: object


TORCH_CHUNK_OPS = ChunkOps("torch", _torch_stats, _torch_grad)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, num_valid: int) -> torch.Tensor:
    z = F.linear(x, weight)  # (c, V/p)
    if num_valid < z.size(-1):
        z[:, num_valid:] = float("-inf")  # padding never takes softmax mass
    return z


def _combine(lse: torch.Tensor, z_t: torch.Tensor, group):
    """Ranks' log-sum-exps and target logits (N,) -> (global log-sum-exp, loss)."""
    if group_size(group) > 1:
        top = lse.clone()
        _all_reduce(top, dist.ReduceOp.MAX, group)
        sums = torch.stack([torch.exp(lse - top), z_t])  # (2, N): exp(-inf) = 0 for padding
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        lse, z_t = top + sums[0].log(), sums[1]
    return lse, lse - z_t


def _accumulate(dw: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """dw (V/p, h) += g^T x: in fp32 (a low-precision product per chunk, summed in fp32)."""
    if dw.dtype == g.dtype:
        dw.addmm_(g.t(), x)
    else:
        dw.add_(torch.mm(g.t(), x))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, sequence_parallel, num_valid, rows, ops):
        full = all_gather_sequence(x, group) if sequence_parallel else x  # (b, s, h)
        if full.shape[:-1] != target.shape:
            raise ValueError(
                f"hidden states (*, h) and labels (*) disagree: {tuple(full.shape)} vs "
                f"{tuple(target.shape)}"
            )
        x2, t = full.reshape(-1, full.size(-1)), target.reshape(-1).long()  # (N, h), (N,)
        n, local_vocab = t.numel(), weight.size(0)
        vocab_start = group_rank(group) * local_vocab
        rows = rows or chunk_rows(n, local_vocab)
        lse = torch.empty(n, dtype=_wide(x.dtype), device=x.device)
        z_t = torch.empty_like(lse)
        for i in range(0, n, rows):
            z = _chunk_logits(x2[i : i + rows], weight, num_valid)
            lse[i : i + rows], z_t[i : i + rows] = ops.stats(z, t[i : i + rows], vocab_start)
            del z  # one chunk's logits alive at a time
        lse, loss = _combine(lse, z_t, group)
        ctx.save_for_backward(x, weight, target, lse)
        ctx.group, ctx.sequence_parallel, ctx.num_valid = group, sequence_parallel, num_valid
        ctx.rows, ctx.ops, ctx.vocab_start = rows, ops, vocab_start
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target, lse = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group) if ctx.sequence_parallel else x
        x2, t = full.reshape(-1, full.size(-1)), target.reshape(-1).long()  # (N, h), (N,)
        dloss = grad_loss.reshape(-1).to(lse.dtype).contiguous()  # (N,); may come expanded
        want_x, want_w = ctx.needs_input_grad[:2]
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device) if want_x else None
        wide = {"dtype": lse.dtype, "device": weight.device}
        dw = torch.zeros(weight.shape, **wide) if want_w else None  # the fp32 (or wider) sum
        rows = ctx.rows
        for i in range(0, t.numel(), rows):
            xc = x2[i : i + rows]
            z = _chunk_logits(xc, weight, ctx.num_valid)
            g = ctx.ops.grad(
                z, t[i : i + rows], ctx.vocab_start, lse[i : i + rows], dloss[i : i + rows]
            )
            del z
            if want_x:
                torch.mm(g, weight, out=dx[i : i + rows])  # (c, h)
            if want_w:
                _accumulate(dw, g, xc)
            del g  # before the next chunk's logits
        if want_x:
            dx = dx.view(full.shape)
            if ctx.sequence_parallel:
                dx = reduce_scatter_sequence(dx, ctx.group)  # (b, s/p, h)
        if want_w:
            dw = dw.to(weight.dtype)
        return dx, dw, None, None, None, None, None, None


def linear_vocab_parallel_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group=None,
    *,
    sequence_parallel: bool = False,
    num_valid: int | None = None,
    rows: int | None = None,
    ops: ChunkOps = TORCH_CHUNK_OPS,
) -> torch.Tensor:
    """Per-token float32 loss (target's shape) of the logits X A_r^T, never materialized whole.

    `x` (*, h), or with `sequence_parallel` this rank's (b, s/p, h) (all-gathered here);
    without it the caller passes x through copy_to_tensor_model_parallel_region, whose backward
    all-reduces dX, as for any column-parallel layer. `weight` this rank's (V/p, h) vocab slice;
    `target` (*) global ids; columns from `num_valid` on are padding (logits -inf). `rows`
    tokens per chunk (default chunk_rows). Targets must be ids of the real vocab (a target
    on no rank counts its logit as 0).
    """
    local_vocab = weight.size(0)
    num_valid = local_vocab if num_valid is None else num_valid
    if x.dtype != weight.dtype:
        raise ValueError(f"hidden states ({x.dtype}) and output weight ({weight.dtype}) differ")
    return _LinearCrossEntropy.apply(
        x, weight, target, group, sequence_parallel, num_valid, rows, ops
    )
