"""A CUDA varlen kernel as the backend of VARLEN masks (packed documents by cu_seqlens,
varlen.py), chosen only on CUDA, and the build log's line saying which path runs them.

The kernel, the first that runs the call:
    varlen_attn       torch.nn.attention.varlen (where this torch has it): FlashAttention
                      over the flattened documents, fp16/bf16, no dropout
    flash_attn        flash-attn's flash_attn_varlen_func (when it is installed): fp16/bf16,
                      with dropout
    flex attention    torch's flex_attention (compiled once) with a document block mask: any
                      float dtype, no dropout
A call none of them runs (dropout without flash-attn, a head size over 256) runs SDPA once per
document (varlen_sdpa.py); the log line says so. None of them builds the (b, 1, s, s) mask.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

from megatron.model.attention.backends import AttentionBackend, register_backend
from megatron.model.attention.varlen import flatten_heads, unflatten_heads
from megatron.model.attention.varlen_sdpa import runs_varlen

HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _flash_attn():
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


@functools.cache
def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def cuda_varlen_kernel(dtype, head_dim: int, dropout: float) -> str | None:
    """The kernel that runs packed documents of this dtype, head size and dropout on CUDA, or
    None where SDPA runs them once per document."""
    flash_fits = dtype in HALF and head_dim <= 256 and head_dim % 8 == 0
    if flash_fits and dropout == 0 and _torch_varlen() is not None:
        return "varlen_attn"
    if flash_fits and _flash_attn() is not None:
        return "flash_attn"
    if dropout == 0 and _flex() is not None:
        return "flex attention"
    return None


def _varlen_attn(core, q, k, v, docs, p):
    fn = _torch_varlen()
    kw = {"scale": core.softmax_scale}
    if "window_size" in inspect.signature(fn).parameters:
        kw["window_size"] = (-1, 0)  # causal
    else:
        kw["is_causal"] = True
    cu, m = docs.cu_seqlens, docs.max_seqlen
    return fn(q, k, v, cu, cu, m, m, **kw)


def _flash(core, q, k, v, docs, p):
    cu, m = docs.cu_seqlens, docs.max_seqlen
    return _flash_attn()(q, k, v, cu, cu, m, m, p, softmax_scale=core.softmax_scale, causal=True)


def _flex_attend(core, q, k, v, docs, p):
    flex, create_block_mask = _flex()
    total = q.size(0)

    def block_mask():
        b = docs.shape[0]
        ids = docs.document_ids.to(q.device)
        ids = ids - ids.amin()  # 0 .. top, then unique over the samples:
        ids = (ids + torch.arange(b, device=q.device).unsqueeze(1) * (ids.amax() + 1)).reshape(-1)

        def same_document_causal(_b, _h, qi, ki):
            return (ids[qi] == ids[ki]) & (qi >= ki)

        return create_block_mask(same_document_causal, 1, None, total, total, device=q.device)

    mask = docs.cached("flex block mask", block_mask)
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, T, d)
    out = flex(qf, kf, vf, block_mask=mask, scale=core.softmax_scale)
    return out[0].transpose(0, 1)


KERNELS = {"varlen_attn": _varlen_attn, "flash_attn": _flash, "flex attention": _flex_attend}


class CudaVarlenBackend(AttentionBackend):
    name, equal_head_dims = "cuda varlen", True

    def accepts(self, core, mask, q):
        if not q.is_cuda or not runs_varlen(core, mask, q):
            return False
        p = core.dropout if core.training else 0.0
        return cuda_varlen_kernel(q.dtype, q.size(-1), p) is not None

    def attend(self, core, q, k, v, mask, p):
        kernel = cuda_varlen_kernel(q.dtype, q.size(-1), p)
        b = q.size(0)
        out = KERNELS[kernel](core, *(flatten_heads(t) for t in (q, k, v)), mask.data, p)
        return unflatten_heads(out, b)


CUDA_VARLEN = register_backend(CudaVarlenBackend(), priority=40)


def varlen_report(cfg, ops, cp_size: int, dtype, device) -> str | None:
    """The build log's line for --reset-attention-mask and --sequence-packing first-fit: which
    path runs the packed documents (`cfg` a MegatronConfig, `ops` its FusedOps), or None
    without them."""
    if not cfg.data.reset_attention_mask and cfg.data.sequence_packing == "concat":
        return None
    head = "Packed documents:"
    if cp_size > 1:
        return f"{head} ring attention within documents (--context-parallel-size {cp_size})"
    m, on = cfg.model, torch.device(device).type
    fp32_flags = ops.softmax_in_fp32 or m.apply_query_key_layer_scaling
    if ops.attention_backend != "sdpa" or (dtype in HALF and fp32_flags):
        why = f"--attention-backend {ops.attention_backend} or the fp32-softmax flags"
        return f"{head} block-diagonal mask through the masked softmax ({why})"
    if cfg.kernels.torch_compile:
        why = "--torch-compile: its graph cannot loop over documents"
        return f"{head} block-diagonal mask through SDPA ({why})"
    kernel = None
    if on == "cuda":
        head_dim = m.head_dim
        if m.multi_latent_attention:  # queries and keys, and the values padded to them
            head_dim = max(m.qk_nope_dim + m.qk_rope_dim, m.v_dim)
        kernel = cuda_varlen_kernel(dtype, head_dim, m.attention_dropout)
    if kernel is None:
        return f"{head} varlen by cu_seqlens, SDPA once per document on {on}"
    return f"{head} varlen by cu_seqlens through {kernel} on cuda"
