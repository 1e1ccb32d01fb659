"""--kernel-library liger: Liger-Kernel's ops against our torch twins (in Triton's CPU
interpreter, where they run), and the dispatch that picks them or refuses."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="Liger-Kernel's ops are Triton kernels")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)

from megatron.config.schema_kernels import KernelConfig  # noqa: E402
from megatron.fused_kernels import FusedOps, liger, select_ops  # noqa: E402
from megatron.fused_kernels import triton_activations as act  # noqa: E402
from megatron.fused_kernels import triton_norms as norms  # noqa: E402
from tests.fused_kernels.compare import check_against_float64  # noqa: E402

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_liger = pytest.mark.skipif(
    not HAS_LIGER, reason="liger-kernel is not installed (pip install --no-deps liger-kernel)"
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LIGER = KernelConfig(kernel_library="liger")


def _run_or_skip(fn, *args):
    """fn(*args), or a skip where Triton's interpreter cannot run Liger's kernel."""
    from triton.runtime.errors import InterpreterError

    try:
        return fn(*args)
    except InterpreterError as e:
        if "'float' object has no attribute 'to'" not in str(e):
            raise
        pytest.skip(
            "Liger-Kernel's norm kernels call eps.to(tl.float32), and Triton's CPU interpreter "
            "passes float arguments as Python floats; they run compiled on a GPU only"
        )


@triton.jit
def _bf16_product_kernel(x_ptr, y_ptr):
    i = tl.arange(0, 4)
    x = tl.load(x_ptr + i)
    tl.store(y_ptr + i, x * x)


def _skip_bf16_math_the_interpreter_gets_wrong(dtype):
    """Liger's SwiGLU multiplies in bf16; Triton 3.9's interpreter returns garbage for a bf16
    product (its fp32 math, which ours uses, is right). Skip only while that is so."""
    if dtype != torch.bfloat16 or os.environ.get("TRITON_INTERPRET") != "1":
        return
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    y = torch.empty_like(x)
    _bf16_product_kernel[(1,)](x, y)
    if not torch.equal(y, x * x):
        pytest.skip(f"Triton's interpreter computes bf16 products wrongly ({y.tolist()})")


@needs_liger
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [1, 7, 100, 257])
def test_liger_swiglu_matches_the_twin(dtype, f):
    _skip_bf16_math_the_interpreter_gets_wrong(dtype)
    x = (2 * torch.randn(2, 3, 2 * f)).to(dtype)  # [gate | up]
    outs, _ = check_against_float64(liger.swiglu, act.torch_swiglu, [x], dtype)
    assert outs[0].shape == (2, 3, f) and outs[0].dtype == dtype


@needs_liger
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_liger_norms_match_the_twins(dtype, with_residual, rms):
    x, residual = (torch.randn(2, 3, 100).to(dtype) for _ in range(2))
    weight, bias = (1 + 0.5 * torch.randn(100)).to(dtype), (0.5 * torch.randn(100)).to(dtype)
    kernel, twin = (
        (liger.add_rms_norm, norms.torch_add_rms_norm)
        if rms
        else (liger.add_layer_norm, norms.torch_add_layer_norm)
    )
    extra = [] if rms else [bias]
    _run_or_skip(kernel, x, None, weight, *extra, 1e-5)  # runs here at all?
    if with_residual:
        inputs = [x, residual, weight, *extra]
        outs, _ = check_against_float64(
            lambda *t: kernel(*t, 1e-5), lambda *t: twin(*t, 1e-5), inputs, dtype
        )
    else:
        outs, _ = check_against_float64(
            lambda x, *t: kernel(x, None, *t, 1e-5),
            lambda x, *t: twin(x, None, *t, 1e-5),
            [x, weight, *extra],
            dtype,
        )
    assert [o.dtype for o in outs] == [dtype, dtype]


@needs_liger
def test_dispatch_takes_liger_where_its_kernel_passes_and_ours_elsewhere():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = select_ops(LIGER, torch.device("cpu"))
    assert ops.swiglu == "liger" and ops.bias_gelu == "triton"
    # Liger's norms cannot run in the interpreter (see above): ours, with the reason said
    if ops.add_norm != "liger":
        assert ops.add_norm == "triton"
        assert any("Liger-Kernel's add_norm kernel" in str(w.message) for w in caught)
    assert "swiglu = liger" in ops.describe()
    off = dataclasses.replace(LIGER, bias_swiglu_fusion=False, layer_norm_fusion=False)
    chosen = select_ops(off, torch.device("cpu"))
    assert (chosen.swiglu, chosen.add_norm) == ("torch", "torch")


@needs_liger
def test_fused_ops_route_swiglu_to_liger():
    x = torch.randn(4, 2 * 24)
    got = FusedOps(swiglu="liger").swiglu_act(x)
    torch.testing.assert_close(got, act.torch_swiglu(x), rtol=1e-5, atol=1e-6)


def test_liger_refused_when_missing_or_without_a_gpu(monkeypatch):
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--kernel-library liger needs the liger-kernel package"):
        select_ops(LIGER, torch.device("cpu"))
    monkeypatch.undo()
    if not HAS_LIGER:
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need a CUDA device.*--kernel-library ours"):
        select_ops(LIGER, torch.device("cpu"))


def test_kernel_library_flag_parses_and_rejects_other_values():
    assert KernelConfig().kernel_library == "ours"
    with pytest.raises(ValueError, match="kernel.library"):
        KernelConfig(kernel_library="apex")
