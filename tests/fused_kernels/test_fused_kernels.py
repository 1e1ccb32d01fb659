"""Triton kernels (run in Triton's CPU interpreter) against float64 torch, forward and backward.

Each kernel runs on inputs in fp32 / fp16 / bf16; its reference runs on the same values cast to
float64, and both get the same upstream gradient. The references themselves are checked against
the float64 formulas (forward and the hand-derived backward) at the end. Loop blocks are shrunk
to 128 columns so that rows of 257 and 1000 take several ragged loop steps, as long rows do on a
GPU; one test runs the default block sizes.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the fused kernels need Triton (its interpreter on CPU)")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)

from megatron.fused_kernels import triton_activations as act  # noqa: E402
from megatron.fused_kernels import triton_cross_entropy as ce  # noqa: E402
from megatron.fused_kernels import triton_norms as norms  # noqa: E402
from megatron.fused_kernels import triton_softmax as sm  # noqa: E402
from tests.fused_kernels.compare import (  # noqa: E402
    TOL,
    as_tuple,
    assert_close,
    check_against_float64,
    forward_backward,
)

# The modules whose rows loop over (or are tiled in) MAX_BLOCK-column blocks; the norms hold a
# whole row in one block.
BLOCKED = (sm, act, ce)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COLS = (1, 7, 100, 257, 1000)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    for module in BLOCKED:
        monkeypatch.setattr(module, "MAX_BLOCK", 128)


# --- softmax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", COLS)
def test_scaled_masked_softmax(dtype, sk):
    scores = (3 * torch.randn(2, 2, 3, sk)).to(dtype)  # (b, h, sq, sk)
    mask = torch.rand(2, 1, 3, sk) < 0.3  # (b, 1, sq, sk), True = masked
    mask[1, 0, 2] = True  # one fully masked row (in both heads)
    outs, grads = check_against_float64(
        lambda x: sm.scaled_masked_softmax(x, mask, 0.5),
        lambda x: sm.torch_scaled_masked_softmax(x, mask, 0.5),
        [scores],
        dtype,
    )
    assert outs[0].dtype == dtype
    assert (outs[0][1, :, 2] == 0).all() and (grads[0][1, :, 2] == 0).all()


def test_scaled_masked_softmax_mask_broadcast_over_batch():
    scores = torch.randn(3, 2, 4, 33)
    mask = torch.ones(1, 1, 4, 33, dtype=torch.bool).triu(1)  # (1, 1, sq, sk)
    check_against_float64(
        lambda x: sm.scaled_masked_softmax(x, mask, 1.3),
        lambda x: sm.torch_scaled_masked_softmax(x, mask, 1.3),
        [scores],
        torch.float32,
    )


def test_scaled_masked_softmax_without_mask():
    check_against_float64(
        lambda x: sm.scaled_masked_softmax(x, None, 0.9),
        lambda x: sm.torch_scaled_masked_softmax(x, None, 0.9),
        [torch.randn(2, 1, 3, 130)],
        torch.float32,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", COLS)
def test_scaled_upper_triang_masked_softmax(dtype, sk):
    scores = (3 * torch.randn(1, 2, 3, sk)).to(dtype)  # sq = 3 <= sk: queries at the end
    outs, _ = check_against_float64(
        lambda x: sm.scaled_upper_triang_masked_softmax(x, 0.125),
        lambda x: sm.torch_scaled_upper_triang_masked_softmax(x, 0.125),
        [scores],
        dtype,
    )
    if sk >= 3:  # key j is visible to query i iff j <= i + sk - 3
        visible = outs[0][0, 0] != 0  # (sq, sk)
        assert (visible.sum(-1) == torch.arange(sk - 2, sk + 1)).all()


@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 3)])  # square; sq > sk: first rows fully masked
def test_scaled_upper_triang_masked_softmax_shapes(sq, sk):
    scores = torch.randn(2, 3, sq, sk)
    outs, grads = check_against_float64(
        lambda x: sm.scaled_upper_triang_masked_softmax(x, 1.0),
        lambda x: sm.torch_scaled_upper_triang_masked_softmax(x, 1.0),
        [scores],
        torch.float32,
    )
    hidden = max(sq - sk, 0)  # rows with no visible key
    assert (outs[0][..., :hidden, :] == 0).all() and (grads[0][..., :hidden, :] == 0).all()


# --- norms -----------------------------------------------------------------------------------


def _norm_inputs(dtype, cols, rows=(2, 3)):
    x = torch.randn(*rows, cols).to(dtype)
    residual = torch.randn(*rows, cols).to(dtype)
    weight = (1 + 0.5 * torch.randn(cols)).to(dtype)
    bias = (0.5 * torch.randn(cols)).to(dtype)
    return x, residual, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_layer_norm(dtype, cols, with_residual):
    x, residual, weight, bias = _norm_inputs(dtype, cols)
    if with_residual:
        inputs = [x, residual, weight, bias]
        kernel = lambda x, r, w, b: norms.fused_add_layer_norm(x, r, w, b, 1e-5)
        reference = lambda x, r, w, b: norms.torch_add_layer_norm(x, r, w, b, 1e-5)
    else:
        inputs = [x, weight, bias]
        kernel = lambda x, w, b: norms.fused_add_layer_norm(x, None, w, b, 1e-5)
        reference = lambda x, w, b: norms.torch_add_layer_norm(x, None, w, b, 1e-5)
    outs, _ = check_against_float64(kernel, reference, inputs, dtype)
    assert [o.dtype for o in outs] == [dtype, dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_rms_norm(dtype, cols, with_residual):
    x, residual, weight, _ = _norm_inputs(dtype, cols)
    if with_residual:
        inputs = [x, residual, weight]
        kernel = lambda x, r, w: norms.fused_add_rms_norm(x, r, w, 1e-5)
        reference = lambda x, r, w: norms.torch_add_rms_norm(x, r, w, 1e-5)
    else:
        inputs = [x, weight]
        kernel = lambda x, w: norms.fused_add_rms_norm(x, None, w, 1e-5)
        reference = lambda x, w: norms.torch_add_rms_norm(x, None, w, 1e-5)
    outs, _ = check_against_float64(kernel, reference, inputs, dtype)
    assert [o.dtype for o in outs] == [dtype, dtype]


def test_norm_weight_grads_over_many_row_chunks():
    # 4 programs of 10 rows (the interpreter's count), 2 rows a step: partial dw sums over
    # ragged chunks; no bias
    x, residual, weight, _ = _norm_inputs(torch.float32, 9, rows=(37,))
    check_against_float64(
        lambda x, r, w: norms.fused_add_layer_norm(x, r, w, None, 1e-5),
        lambda x, r, w: norms.torch_add_layer_norm(x, r, w, None, 1e-5),
        [x, residual, weight],
        torch.float32,
    )


# --- activations -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", COLS)
def test_bias_gelu(dtype, cols):
    x, bias = (2 * torch.randn(2, 3, cols)).to(dtype), torch.randn(cols).to(dtype)
    outs, _ = check_against_float64(act.bias_gelu, act.torch_bias_gelu, [x, bias], dtype)
    assert outs[0].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_tanh_form(dtype):
    """--openai-gelu: the kernel's tanh GeLU (forward and both grads) against F.gelu's."""
    x, bias = (2 * torch.randn(2, 3, 40)).to(dtype), torch.randn(40).to(dtype)
    tanh = check_against_float64(
        lambda x, b: act.bias_gelu(x, b, "tanh"),
        lambda x, b: act.torch_bias_gelu(x, b, "tanh"),
        [x, bias],
        dtype,
    )[0][0]
    assert not torch.allclose(tanh.float(), act.bias_gelu(x, bias).float(), atol=1e-6)


def test_bias_gelu_bias_grad_over_many_row_chunks():
    # 4 programs of 10 rows, 4 rows a step: partial bias-grad sums over ragged chunks
    x, bias = torch.randn(37, 7), torch.randn(7)
    check_against_float64(act.bias_gelu, act.torch_bias_gelu, [x, bias], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", COLS)
def test_swiglu(dtype, f):
    x = (2 * torch.randn(2, 3, 2 * f)).to(dtype)  # [gate | up]
    outs, _ = check_against_float64(act.swiglu, act.torch_swiglu, [x], dtype)
    assert outs[0].shape == (2, 3, f) and outs[0].dtype == dtype


# --- cross entropy ---------------------------------------------------------------------------


def _logits_and_target(dtype, vocab, rows=(2, 3)):
    pad = vocab // 8  # the padded tail of the vocab is -inf, as the model produces
    logits = (3 * torch.randn(*rows, vocab)).to(dtype)
    logits[..., vocab - pad :] = float("-inf")
    target = torch.randint(0, vocab - pad, rows)
    target.view(-1)[0] = vocab - pad - 1  # the last real token, next to the padding
    return logits, target


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", COLS)
def test_vocab_parallel_cross_entropy_fused(dtype, vocab):
    logits, target = _logits_and_target(dtype, vocab)
    outs, grads = check_against_float64(
        lambda z: ce.vocab_parallel_cross_entropy_fused(z, target),
        lambda z: ce.torch_vocab_parallel_cross_entropy(z, target),
        [logits],
        dtype,
    )
    assert outs[0].dtype == torch.float32 and outs[0].shape == target.shape
    assert grads[0].dtype == dtype
    assert (grads[0][..., vocab - vocab // 8 :] == 0).all()  # padding: probability 0


# --- whole-op properties ---------------------------------------------------------------------


OPS = {  # name: (kernel, reference, inputs)
    "masked_softmax": (
        lambda x: sm.scaled_masked_softmax(x, torch.eye(20, dtype=torch.bool), 0.3),
        lambda x: sm.torch_scaled_masked_softmax(x, torch.eye(20, dtype=torch.bool), 0.3),
        lambda: [torch.randn(1, 2, 20, 20)],
    ),
    "causal_softmax": (
        lambda x: sm.scaled_upper_triang_masked_softmax(x, 0.3),
        lambda x: sm.torch_scaled_upper_triang_masked_softmax(x, 0.3),
        lambda: [torch.randn(1, 2, 4, 1000)],
    ),
    "layer_norm": (
        lambda *t: norms.fused_add_layer_norm(*t, 1e-5),
        lambda *t: norms.torch_add_layer_norm(*t, 1e-5),
        lambda: list(_norm_inputs(torch.float32, 1000)),
    ),
    "rms_norm": (
        lambda *t: norms.fused_add_rms_norm(*t, 1e-5),
        lambda *t: norms.torch_add_rms_norm(*t, 1e-5),
        lambda: list(_norm_inputs(torch.float32, 1000)[:3]),
    ),
    "bias_gelu": (
        act.bias_gelu,
        act.torch_bias_gelu,
        lambda: [torch.randn(5, 1000), torch.randn(1000)],
    ),
    "swiglu": (act.swiglu, act.torch_swiglu, lambda: [torch.randn(5, 2000)]),
    "cross_entropy": (
        lambda z, t: ce.vocab_parallel_cross_entropy_fused(z, t),
        lambda z, t: ce.torch_vocab_parallel_cross_entropy(z, t),
        lambda: list(_logits_and_target(torch.float32, 1000)),
    ),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_default_block_sizes(op, monkeypatch):
    """The production configuration: rows up to 4096 columns in one block."""
    monkeypatch.undo()  # back to each module's own MAX_BLOCK
    kernel, reference, make_inputs = OPS[op]
    check_against_float64(kernel, reference, make_inputs(), torch.float32)


@pytest.mark.parametrize("op", sorted(OPS))
def test_expanded_upstream_gradient(op):
    """A stride-0 upstream gradient (as out.sum().backward() gives) is read correctly."""
    kernel, reference, make_inputs = OPS[op]
    inputs = make_inputs()
    upstream = [torch.randn(o.shape[-1]).expand(o.shape) for o in as_tuple(kernel(*inputs))]
    _, grads, _ = forward_backward(kernel, inputs, upstream)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    _, ref_grads, _ = forward_backward(reference, wide, [u.double() for u in upstream])
    for got, want in zip(grads, ref_grads, strict=True):
        if want is not None:
            assert_close(got, want, TOL[torch.float32], op)


# --- the references against the float64 formulas ---------------------------------------------


def _grads(fn, inputs, upstream):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    torch.autograd.backward(out, upstream)
    return out.detach(), [t.grad for t in leaves]


def _assert_formula(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_reference_softmax_formulas():
    x = torch.randn(2, 2, 4, 9, dtype=torch.float64)
    mask = torch.rand(2, 1, 4, 9) < 0.4
    mask[0, 0, 1] = True  # fully masked row
    dy = torch.randn_like(x)
    y, (dx,) = _grads(lambda s: sm.torch_scaled_masked_softmax(s, mask, 0.7), [x], dy)
    e = torch.where(mask, 0.0, torch.exp(0.7 * x - (0.7 * x).amax(-1, keepdim=True)))
    want = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    _assert_formula(y, want)
    _assert_formula(dx, 0.7 * want * (dy - (dy * want).sum(-1, keepdim=True)))

    causal = torch.ones(4, 9, dtype=torch.bool).triu(9 - 4 + 1)  # j > i + sk - sq
    _assert_formula(
        sm.torch_scaled_upper_triang_masked_softmax(x, 0.7),
        sm.torch_scaled_masked_softmax(x, causal, 0.7),
    )
    assert sm.torch_scaled_masked_softmax(x.bfloat16(), mask, 0.7).dtype == torch.bfloat16


def _layer_norm_grads(h, w, dy, rms):
    """The backward of the module docstring, in float64."""
    mean = 0 if rms else h.mean(-1, keepdim=True)
    var = (h**2).mean(-1, keepdim=True) if rms else h.var(-1, unbiased=False, keepdim=True)
    rstd = (var + 1e-5).rsqrt()
    xhat = (h - mean) * rstd
    g = w * dy
    mean_g = 0 if rms else g.mean(-1, keepdim=True)
    dh = rstd * (g - xhat * (xhat * g).mean(-1, keepdim=True) - mean_g)
    return xhat, dh, (dy * xhat).sum((0, 1)), dy.sum((0, 1))


@pytest.mark.parametrize("rms", [False, True])
def test_reference_norm_formulas(rms):
    x, r, w, b = (t.double() for t in _norm_inputs(torch.float32, 33))
    dy = torch.randn_like(x)
    xhat, dh, dw, db = _layer_norm_grads(x + r, w, dy, rms)
    if rms:
        (y, h) = norms.torch_add_rms_norm(x, r, w, 1e-5)
        _, grads = _grads(lambda *t: norms.torch_add_rms_norm(*t, 1e-5)[0], [x, r, w], dy)
        want_y, want_grads = xhat * w, [dh, dh, dw]
    else:
        (y, h) = norms.torch_add_layer_norm(x, r, w, b, 1e-5)
        _, grads = _grads(lambda *t: norms.torch_add_layer_norm(*t, 1e-5)[0], [x, r, w, b], dy)
        want_y, want_grads = xhat * w + b, [dh, dh, dw, db]
    _assert_formula(h, x + r)
    _assert_formula(y, want_y)
    for got, want in zip(grads, want_grads, strict=True):
        _assert_formula(got, want)


def test_reference_activation_formulas():
    x, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    dy = torch.randn(5, 8, dtype=torch.float64)
    z = x + b
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    dz = dy * (cdf + z * torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi))
    y, (dx, dbias) = _grads(act.torch_bias_gelu, [x, b], dy)
    _assert_formula(y, z * cdf)
    _assert_formula(dx, dz)
    _assert_formula(dbias, dz.sum(0))

    x2 = torch.randn(5, 16, dtype=torch.float64)
    gate, up = x2[:, :8], x2[:, 8:]
    s = torch.sigmoid(gate)
    y, (dx2,) = _grads(act.torch_swiglu, [x2], dy)
    _assert_formula(y, gate * s * up)
    _assert_formula(dx2, torch.cat([dy * up * s * (1 + gate * (1 - s)), dy * gate * s], -1))


def test_reference_cross_entropy_formula():
    logits, target = _logits_and_target(torch.float64, 40)
    dloss = torch.randn(target.shape, dtype=torch.float64)
    loss, (dz,) = _grads(
        lambda z: ce.torch_vocab_parallel_cross_entropy(z, target), [logits], dloss
    )
    onehot = torch.nn.functional.one_hot(target, 40).double()
    _assert_formula(loss, logits.logsumexp(-1) - logits.gather(-1, target[..., None])[..., 0])
    _assert_formula(dz, (logits.softmax(-1) - onehot) * dloss[..., None])
