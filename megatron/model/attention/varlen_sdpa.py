"""SDPA once per document as the backend of VARLEN masks (varlen.py): the CPU's path for packed
documents, and CUDA's where no varlen kernel runs the call (varlen_cuda.py says when). Each
document of the flattened batch is one causal SDPA call on its own queries, keys and values:
no (b, 1, s, s) mask, and no score between documents is computed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.attention.backends import AttentionBackend, register_backend
from megatron.model.attention.sdpa import sdpa_context
from megatron.model.attention.varlen import VARLEN, flatten_heads, unflatten_heads


def runs_varlen(core, mask, q) -> bool:
    """A VARLEN mask over a whole micro batch (its s queries) on the SDPA path, outside
    torch.compile (whose graph cannot loop over data-dependent documents: it runs the dense
    mask through SDPA)."""
    return (
        mask.type is VARLEN
        and core.ops.attention_backend == "sdpa"
        and not core.fp32_softmax(q.dtype)
        and q.size(2) == mask.data.shape[1]
        and not torch.compiler.is_compiling()
    )


class SdpaDocumentsBackend(AttentionBackend):
    name, equal_head_dims = "sdpa per document", True

    def accepts(self, core, mask, q):
        return runs_varlen(core, mask, q)

    def attend(self, core, q, k, v, mask, p):
        b = q.size(0)
        # (b, heads, s, d) -> (1, heads, b x s, d): documents are runs of the flattened tokens
        qf, kf, vf = (flatten_heads(t).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        bounds = mask.data.bounds
        outs = []
        with sdpa_context(core.ops.sdpa_backend):
            for a, e in zip(bounds[:-1], bounds[1:], strict=False):
                outs.append(
                    F.scaled_dot_product_attention(
                        qf[:, :, a:e],
                        kf[:, :, a:e],
                        vf[:, :, a:e],
                        dropout_p=p,
                        is_causal=True,
                        scale=core.softmax_scale,
                    )
                )
        out = torch.cat(outs, dim=2)[0].transpose(0, 1)  # (b x s, heads, d_v)
        return unflatten_heads(out, b)


SDPA_DOCUMENTS = register_backend(SdpaDocumentsBackend(), priority=50)
