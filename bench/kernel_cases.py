"""The ops bench/kernels.py measures: inputs, the four implementations, and the bytes each pass
must move at least (each input read once, each output written once; the small vectors, per-row
statistics and partial sums are left out).

The minimum traffic per op is TRAFFIC below (bench/kernels.py prints it with its table).

Eager is the model's own torch path for the op (bf16 LayerNorm after a torch add; the fp32
RMSNorm math of model.transformer.RMSNorm; F.gelu of x + b; silu(gate) * up; the vocab-parallel
cross-entropy in fp32); compile is torch.compile of the same function; liger is what
--kernel-library liger runs (None where Liger has no such op: ours serves it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.fused_kernels import liger, reference
from megatron.fused_kernels import triton_activations as acts
from megatron.fused_kernels import triton_cross_entropy as xent
from megatron.fused_kernels import triton_norms as norms
from megatron.fused_kernels import triton_softmax as softmax
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy

EPS = 1e-5
TRAFFIC = """\
op               forward traffic                backward traffic
causal softmax   x -> y                  2 T    y, dy -> dx                 3 T
add + LayerNorm  x, residual -> h, y     4 T    dy, h, dh -> dx             4 T
add + RMSNorm    x, residual -> h, y     4 T    dy, h, dh -> dx             4 T
bias + GeLU      x -> y                  2 T    x, dy -> dx                 3 T
SwiGLU           x (2f) -> y (f)         3 T/2  x, dy -> dx                 5 T/2
cross-entropy    logits -> loss          1 T    logits -> dlogits           2 T
(T = bytes of the op's main input, x or the logits; SwiGLU's x holds [gate | up].)
"""
IMPLS = ("ours", "liger", "eager", "compile")


@dataclass
class Case:
    op: str
    shape: str
    inputs: list  # tensors; the floating ones are autograd leaves
    impls: dict  # name -> fn(*inputs) or None (no such op there)
    bytes: dict  # pass -> bytes


def _traffic(t: torch.Tensor, fwd: float, bwd: float) -> dict:
    size = t.numel() * t.element_size()
    return {"fwd": fwd * size, "bwd": bwd * size, "fwd+bwd": (fwd + bwd) * size}


def _impls(ours, liger_fn, eager, compile_backend: str | None) -> dict:
    compiled = None
    if compile_backend is not None:
        compiled = torch.compile(eager, backend=compile_backend, dynamic=False)
    return {"ours": ours, "liger": liger_fn, "eager": eager, "compile": compiled}


def _softmax_cases(r, shapes, backend):
    for b, h, s in shapes:
        x = r(b, h, s, s)
        yield Case(
            "causal softmax",
            f"b{b} h{h} s{s}",
            [x],
            _impls(
                lambda x: softmax.scaled_upper_triang_masked_softmax(x, 0.125),
                None,
                lambda x: reference.torch_scaled_upper_triang_masked_softmax(x, 0.125),
                backend,
            ),
            _traffic(x, 2, 3),
        )


def _eager_add_layer_norm(x, r, w, b):
    h = x + r
    return F.layer_norm(h, h.shape[-1:], w, b, EPS), h


def _norm_cases(r, rows, hidden, backend):
    x, res, w, b = r(rows, hidden), r(rows, hidden), r(hidden), r(hidden)
    yield Case(
        "add + LayerNorm",
        f"{rows}x{hidden}",
        [x, res, w, b],
        _impls(
            lambda *t: norms.fused_add_layer_norm(*t, EPS),
            lambda *t: liger.add_layer_norm(*t, EPS),
            _eager_add_layer_norm,
            backend,
        ),
        _traffic(x, 4, 4),
    )
    yield Case(
        "add + RMSNorm",
        f"{rows}x{hidden}",
        [x, res, w],
        _impls(
            lambda *t: norms.fused_add_rms_norm(*t, EPS),
            lambda *t: liger.add_rms_norm(*t, EPS),
            lambda *t: norms.torch_add_rms_norm(*t, EPS),
            backend,
        ),
        _traffic(x, 4, 4),
    )


def _mlp_cases(r, rows, ffn, backend):
    x, b = r(rows, ffn), r(ffn)
    yield Case(
        "bias + GeLU",
        f"{rows}x{ffn}",
        [x, b],
        _impls(acts.bias_gelu, None, lambda x, b: F.gelu(x + b), backend),
        _traffic(x, 2, 3),
    )
    z = r(rows, 2 * ffn)  # [gate | up]
    yield Case(
        "SwiGLU",
        f"{rows}x{2 * ffn}",
        [z],
        _impls(acts.swiglu, liger.swiglu, reference.torch_swiglu, backend),
        _traffic(z, 1.5, 2.5),
    )


def _cross_entropy_cases(r, shapes, backend, device):
    for rows, vocab in shapes:
        logits = r(rows, vocab)
        target = torch.randint(0, vocab, (rows,), device=device)
        yield Case(
            "cross-entropy",
            f"{rows}x{vocab}",
            [logits, target],
            _impls(
                xent.vocab_parallel_cross_entropy_fused,
                None,
                vocab_parallel_cross_entropy,
                backend,
            ),
            _traffic(logits, 1, 2),
        )


def cases(dtype, device, sizes: dict, ops: set, compile_backend: str | None, with_liger: bool):
    """The Cases of `ops`, one at a time (each holds its inputs only while it is measured)."""

    def r(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)

    makers: dict[str, Callable] = {
        "softmax": lambda: _softmax_cases(r, sizes["softmax"], compile_backend),
        "norms": lambda: (
            c for h in sizes["hidden"] for c in _norm_cases(r, sizes["rows"], h, compile_backend)
        ),
        "mlp": lambda: (
            c for h in sizes["hidden"] for c in _mlp_cases(r, sizes["rows"], 4 * h, compile_backend)
        ),
        "cross_entropy": lambda: _cross_entropy_cases(r, sizes["vocab"], compile_backend, device),
    }
    for group in ("softmax", "norms", "mlp", "cross_entropy"):
        if group not in ops:
            continue
        for case in makers[group]():
            if not with_liger:
                case.impls["liger"] = None
            yield case
