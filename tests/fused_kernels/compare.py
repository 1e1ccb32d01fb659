"""The kernels' yardstick: a kernel against its torch reference run in float64 on the same
input values, forward and backward (shared by the tests of this folder)."""

import torch

# Max error allowed, relative to the largest reference value. The float64 reference sees the
# very same input values, so the error is the kernel's own rounding: in fp32, accumulation over
# <= 1000 terms and fp32 exp/erf (worst seen 4e-7); in half precision, rounding of the stored
# outputs and intermediates (h, the saved softmax y), a few units of the unit roundoff 2^-11
# (fp16: worst seen 7e-4) or 2^-8 (bf16: worst seen 8e-3). Each bound leaves a margin >= 2.5x.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def assert_close(actual, expected, tol, what):
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual.double() - expected).abs().max()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def forward_backward(fn, inputs, upstream=None):
    """Outputs and input grads of fn; upstream grads default to random ones of the outputs."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = as_tuple(fn(*leaves))
    if upstream is None:
        upstream = [torch.randn(o.shape).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, [u.to(o.dtype) for u, o in zip(upstream, outs, strict=True)])
    grads = [t.grad if t.is_floating_point() else None for t in leaves]
    return [o.detach() for o in outs], grads, upstream


def check_against_float64(kernel, reference, inputs, dtype):
    """kernel(*inputs) vs reference(*inputs in float64): outputs, dtypes and every input grad."""
    outs, grads, upstream = forward_backward(kernel, inputs)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    ref_outs, ref_grads, _ = forward_backward(reference, wide, [u.double() for u in upstream])
    tol = TOL[dtype]
    for i, (out, ref) in enumerate(zip(outs, ref_outs, strict=True)):
        assert out.shape == ref.shape
        assert_close(out, ref, tol, f"output {i}")
    for i, (grad, ref) in enumerate(zip(grads, ref_grads, strict=True)):
        if ref is not None:
            assert grad is not None and grad.dtype == inputs[i].dtype
            assert_close(grad, ref, tol, f"grad of input {i}")
    return outs, grads
