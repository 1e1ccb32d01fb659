"""Ring attention's contract on one row of queries, for the block tests (tests/mpu and
tests/gpu): two key blocks merged by their LSE, each differentiated from the merged result."""

from __future__ import annotations

import math

import torch

from megatron.mpu.context_parallel import _merge
from megatron.mpu.ring_blocks import block_step


def two_block_row(blocks, q, k, v, dout, split: int):
    """Queries q (the last q.size(2) positions of the keys) attend causally to keys [0, split)
    (a full block) and [split, s) (the diagonal block): forward both blocks, merge them by
    their LSE, then backward each block from the merged out and LSE, as the ring does.
    Returns (out, lse, dq, dk, dv) in fp32."""
    scale, dt = 1.0 / math.sqrt(q.size(-1)), blocks.dtype(q.dtype)
    q, k, v, dout = (t.to(dt) for t in (q, k, v, dout))
    parts = ((k[:, :, :split], v[:, :, :split], False), (k[:, :, split:], v[:, :, split:], True))
    out = lse = None
    replays = []
    for kb, vb, causal in parts:
        o, s, replay = block_step(blocks, q, kb, vb, scale, causal, 0.0)
        replays.append(replay)
        out, lse = (o.float(), s) if out is None else _merge(out, lse, o.float(), s)
    final = out.to(dt)
    dq = torch.zeros_like(out)
    dks, dvs = [], []
    for (kb, vb, causal), replay in zip(parts, replays, strict=True):
        dq_b, dk_b, dv_b = blocks.backward(q, kb, vb, dout, final, lse, scale, causal, 0.0, replay)
        dq += dq_b
        dks.append(dk_b.float())
        dvs.append(dv_b.float())
    return out, lse, dq, torch.cat(dks, 2), torch.cat(dvs, 2)
