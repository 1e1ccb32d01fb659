"""Attention sinks (--softmax-type, Megatron-core's names): one more logit in every softmax row,
whose value goes nowhere, so a query may give part of its attention to nothing.

    off-by-one  the extra logit is a fixed 0: exp(x_i) / (1 + sum_j exp(x_j))
    learnable   one learned logit per head (gpt-oss's `sinks`), `softmax_offset` of the core
                attention, split over TP with the heads (checkpointed and resharded as they)

The sink backend runs them: the explicit scores, masked by any mask kind's dense form, the sink
column appended, the softmax in fp32, the column dropped. It is asked before the masked-softmax
and SDPA backends (SDPA's kernels take no extra logit); the ring (context parallelism) merges its
blocks without one and is refused with sinks (megatron.config.rules_window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.attention.backends import AttentionBackend, register_backend
from megatron.model.attention.softmax import _scores
from megatron.model.context import BuildContext
from megatron.mpu.layers import set_tensor_model_parallel_attributes


def learnable_sink(heads: int, ctx: BuildContext) -> nn.Parameter:
    """One sink logit per local head (this TP rank's heads), split over TP on dim 0."""
    param = nn.Parameter(torch.zeros(heads, device=ctx.device, dtype=ctx.dtype))
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


def sink_softmax(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of `logits` (b, heads, s_q, s_k; -inf where masked) with one
    more logit per head, `sink` (heads,), whose probability is dropped; fp32 (or wider)
    inside."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    column = sink.to(dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits.to(dtype), column], dim=-1), dim=-1)
    return probs[..., :-1]


class SinkBackend(AttentionBackend):
    name = "sink"

    def accepts(self, core, mask, q):
        return core.softmax_type != "vanilla"

    def attend(self, core, q, k, v, mask, p):
        raw, scale = _scores(core, q, k)  # (b, heads, s_q, s_k)
        keep = mask.dense(q.size(2), k.size(2), q.device)
        logits = raw.to(torch.promote_types(raw.dtype, torch.float32)) * scale
        logits = logits.masked_fill(~keep, float("-inf"))
        probs = sink_softmax(logits, core.sink_logits(q.size(1), q.device)).to(v.dtype)
        return torch.matmul(F.dropout(probs, p), v)


SINK = register_backend(SinkBackend(), priority=5)
