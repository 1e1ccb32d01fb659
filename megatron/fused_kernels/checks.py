"""One small forward + backward per kernel against its float32-accumulating torch twin (in the
triton_* module), run once at model build: ours ("triton") and Liger-Kernel's ("liger")."""

from __future__ import annotations

import torch


def _close(a, b) -> bool:
    return all(
        torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-4)
        for x, y in zip(a, b, strict=True)
    )


def _run(fn, inputs):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs], [torch.ones_like(o) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in leaves if t.grad is not None]


def _compare(fused, reference, inputs) -> bool:
    return _close(_run(fused, inputs), _run(reference, inputs))


def _softmax(device):
    from megatron.fused_kernels import triton_softmax as s

    x = torch.randn(1, 2, 5, 7, device=device)
    return _compare(
        lambda t: s.scaled_upper_triang_masked_softmax(t, 0.5),
        lambda t: s.torch_scaled_upper_triang_masked_softmax(t, 0.5),
        [x],
    )


def _add_norm(device, kernels=None):
    """add + LayerNorm and add + RMSNorm with a residual, as the model calls them (each width
    is autotuned on a GPU's first call: one shape keeps the start-up short)."""
    from megatron.fused_kernels import triton_norms as n

    layer_norm, rms_norm = kernels or (n.fused_add_layer_norm, n.fused_add_rms_norm)
    x, res = torch.randn(3, 33, device=device), torch.randn(3, 33, device=device)
    w, b = torch.randn(33, device=device), torch.randn(33, device=device)
    return _compare(
        lambda *t: layer_norm(*t, 1e-5),
        lambda *t: n.torch_add_layer_norm(*t, 1e-5),
        [x, res, w, b],
    ) and _compare(
        lambda *t: rms_norm(*t, 1e-5),
        lambda *t: n.torch_add_rms_norm(*t, 1e-5),
        [x, res, w],
    )


def _bias_gelu(device):
    from megatron.fused_kernels import triton_activations as a

    x, b = torch.randn(3, 40, device=device), torch.randn(40, device=device)
    return all(
        _compare(
            lambda x, b: a.bias_gelu(x, b, approx),  # noqa: B023 - called at once
            lambda x, b: a.torch_bias_gelu(x, b, approx),  # noqa: B023
            [x, b],
        )
        for approx in ("none", "tanh")
    )


def _swiglu(device, kernel=None):
    from megatron.fused_kernels import triton_activations as a

    x = torch.randn(3, 2 * 20, device=device)
    return _compare(kernel or a.swiglu, a.torch_swiglu, [x])


def _cross_entropy(device):
    from megatron.fused_kernels.triton_cross_entropy import vocab_parallel_cross_entropy_fused
    from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy

    logits, target = torch.randn(4, 50, device=device), torch.randint(0, 50, (4,), device=device)
    return _compare(
        lambda t: vocab_parallel_cross_entropy_fused(t, target),
        lambda t: vocab_parallel_cross_entropy(t, target),
        [logits],
    )


def _liger_add_norm(device):
    from megatron.fused_kernels import liger

    return _add_norm(device, (liger.add_layer_norm, liger.add_rms_norm))


def _liger_swiglu(device):
    from megatron.fused_kernels import liger

    return _swiglu(device, liger.swiglu)


CHECKS = {  # implementation: {op: check}
    "triton": {
        "softmax": _softmax,
        "add_norm": _add_norm,
        "bias_gelu": _bias_gelu,
        "swiglu": _swiglu,
        "cross_entropy": _cross_entropy,
    },
    "liger": {"add_norm": _liger_add_norm, "swiglu": _liger_swiglu},
}
