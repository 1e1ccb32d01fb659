"""Ring attention's contract on one row of queries, for the block tests (tests/mpu and
tests/gpu): two key blocks merged by their LSE, each differentiated from the merged result."""

from __future__ import annotations

import math

import torch

from megatron.model.attention.masks import document_attention_mask
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


# ---- packed documents (--reset-attention-mask) for ring attention's document masks ----

# Document lengths of two 32-token samples. PACKED: documents crossing chunk boundaries, chunks
# entirely inside one document, chunk pairs with no document in common (skipped) and rows with
# no key in a block (at 2 x CP = 4 and 8 chunks). MIXED: one sample a single document, the
# other many short ones (a pair's kind must hold for the whole batch). SINGLETONS: every token
# its own document (each query sees only itself).
PACKED = ((3, 5, 18, 2, 4), (2, 6, 18, 3, 3))
MIXED = ((32,), (5, 3, 3, 9, 1, 2, 4, 5))
SINGLETONS = ((1,) * 32, (1,) * 32)
LAYOUTS = {"packed": PACKED, "mixed": MIXED, "singletons": SINGLETONS}


def document_ids(lengths) -> torch.Tensor:
    """Per-sample document lengths -> (b, s) ids 0, 0, 1, ... as the data path numbers them."""
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths]
    return torch.stack(rows)


def document_attention(q, k, v, ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents over whole sequences, through SDPA with the (s, s)
    mask the single-process model uses; k, v may have fewer (GQA) heads than q."""
    rep = q.size(1) // k.size(1)
    k, v = (t.repeat_interleave(rep, 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_attention_mask(ids)
    )
