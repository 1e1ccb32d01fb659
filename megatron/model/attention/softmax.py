"""softmax(scale q k^T) v with the masked softmax of fused_kernels (--attention-backend fused:
Triton; unfused: torch), in fp32 inside the kernel: the path of --attention-backend fused /
unfused, and of the v1.x precision flags (--attention-softmax-in-fp32,
--apply-query-key-layer-scaling) in half precision, where SDPA's softmax precision would be its
kernel's choice."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron.model.attention.backends import AttentionBackend, register_backend


class SoftmaxBackend(AttentionBackend):
    name = "softmax"

    def accepts(self, core, mask, q):
        return core.ops.attention_backend != "sdpa" or core.fp32_softmax(q.dtype)

    def attend(self, core, q, k, v, mask, p):
        scores, scale = _scores(core, q, k)  # (b, heads, s_q, s_k)
        if mask.type.causal:  # the queries at the end of the keys
            probs = core.ops.causal_softmax(scores, scale)  # fp32 math inside
        else:  # padding, documents, a KV-cache prefix, any other kind's dense mask
            keep = mask.dense(q.size(2), k.size(2), q.device)
            probs = core.ops.masked_softmax(scores, keep, scale)  # fp32 inside
        return torch.matmul(F.dropout(probs, p), v)


def _scores(core, q, k):
    """(q k^T, softmax scale); with --apply-query-key-layer-scaling (q k^T / (sqrt(d) L), L),
    the division done inside the GEMM so fp16 scores stay L times smaller."""
    if core.qk_coeff is None:
        scale = core.softmax_scale or 1.0 / math.sqrt(q.size(-1))
        return torch.matmul(q, k.transpose(-1, -2)), scale
    b, n, sq, d = q.shape
    q3, k3 = q.reshape(b * n, sq, d), k.reshape(b * n, -1, d)  # (b heads, s, d)
    out = torch.empty(b * n, sq, k3.size(1), dtype=q.dtype, device=q.device)
    alpha = 1.0 / (math.sqrt(d) * core.qk_coeff)
    out = torch.baddbmm(out, q3, k3.transpose(1, 2), beta=0.0, alpha=alpha)
    return out.view(b, n, sq, -1), core.qk_coeff


SOFTMAX = register_backend(SoftmaxBackend(), priority=10)
