"""Float8 GEMMs of the TP linears (megatron.mpu.fp8) on the CPU, through torchao's emulation:
the same float8 rounding, the GEMMs in fp32. Tolerances (relative Frobenius error against the
same layer in bf16, 256 tokens of width 64 -> 128): the output and e4m3 gradients within 5%
(e4m3 keeps 3 mantissa bits: ~3.7% measured), e5m2 gradients (--fp8-format hybrid) within 8%
(2 mantissa bits: ~6%); and above 1%, so a layer that silently ran in bf16 fails."""

import pytest
import torch

from megatron import mpu
from megatron.mpu import fp8

pytest.importorskip("torchao", reason=f"pip install {fp8.TORCHAO_REQUIREMENT} (the fp8 extra)")

BF16 = torch.bfloat16
FORMATS_RECIPES = [(f, r) for f in fp8.FP8_FORMATS for r in fp8.FP8_RECIPES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _layer(kind: str, matmul):
    gen = torch.Generator().manual_seed(1)
    if kind == "column":
        layer = mpu.ColumnParallelLinear(64, 128, init_method=mpu.init_normal(0.02, gen))
    else:
        layer = mpu.RowParallelLinear(128, 64, init_method=mpu.init_normal(0.02, gen))
    with torch.no_grad():
        layer.bias.normal_(0, 0.02, generator=gen)
    layer.to(BF16).fp8 = matmul
    return layer


def _run(layer, x, grad):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("fmt,recipe", FORMATS_RECIPES)
def test_a_float8_linear_matches_bf16_within_the_stated_tolerance(kind, fmt, recipe):
    matmul = fp8.Float8Matmul(fmt, recipe, emulate=True)
    width = 64 if kind == "column" else 128
    x = torch.randn(4, 64, width, dtype=BF16)
    grad = torch.randn(4, 64, 128 if kind == "column" else 64, dtype=BF16)
    ref = _run(_layer(kind, None), x, grad)
    got = _run(_layer(kind, matmul), x, grad)
    grad_tol = 0.08 if fmt == "hybrid" else 0.05
    tols = {"output": 0.05, "dL/dX": grad_tol, "dL/dW": grad_tol}
    for (name, tol), a, b in zip(tols.items(), got[:3], ref[:3], strict=True):
        assert a.dtype == BF16, f"{name} left in {a.dtype}"
        err = _rel(a, b)
        assert 0.01 < err < tol, f"{fmt}/{recipe} {kind} {name}: relative error {err:.4f}"
    # the bias is added outside the float8 GEMM: its gradient is the bf16 sum of dL/dY
    torch.testing.assert_close(got[3], ref[3])


def test_the_split_forward_and_backward_equal_torchaos_autograd_function():
    """forward_mm / backward_mm (the sequence-parallel gathered linear's path) run exactly the
    math of Float8Matmul.linear (torchao's autograd function)."""
    matmul = fp8.Float8Matmul("hybrid", "tensorwise", emulate=True)
    x = torch.randn(2, 24, 32, dtype=BF16, requires_grad=True)
    w = torch.randn(48, 32, dtype=BF16, requires_grad=True)
    grad = torch.randn(2, 24, 48, dtype=BF16)
    y = matmul.linear(x, w)
    y.backward(grad)
    with torch.no_grad():
        y2 = matmul.forward_mm(x, w)
        gx, gw = matmul.backward_mm(grad, x, w)
    assert torch.equal(y2, y) and torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
    assert gw.shape == w.shape and gw.is_contiguous()


def test_a_token_count_not_a_multiple_of_16_pads_only_the_weight_gradient_gemm():
    matmul = fp8.Float8Matmul("e4m3", "tensorwise", emulate=True)
    aligned, ragged = matmul._mm_for(torch.empty(2, 8, 32)), matmul._mm_for(torch.empty(3, 5, 32))
    assert not any(c.pad_inner_dim for c in aligned)
    assert [c.pad_inner_dim for c in ragged] == [False, False, True]
    x = torch.randn(3, 5, 32, dtype=BF16, requires_grad=True)
    w = torch.randn(16, 32, dtype=BF16, requires_grad=True)
    matmul.linear(x, w).sum().backward()
    assert w.grad.shape == w.shape and x.grad.shape == x.shape


def test_the_torch_linear_path_is_unchanged_without_fp8():
    layer = _layer("column", None)
    x = torch.randn(2, 8, 64, dtype=BF16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_devices_without_float8_matmul_are_named(monkeypatch):
    problem = fp8.device_problem(torch.device("cpu"))
    assert "no float8 matmul" in problem and "8.9" in problem
    assert fp8.device_problem(torch.device("cpu"), emulate=True) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    problem = fp8.device_problem(torch.device("cuda", 0))
    assert "NVIDIA A100 (compute capability 8.0)" in problem and "8.9 or newer" in problem
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.device_problem(torch.device("cuda", 0)) is None


def test_emulation_is_asked_for_by_the_environment_only(monkeypatch):
    monkeypatch.delenv(fp8.EMULATE_ENV, raising=False)
    assert not fp8.emulation_requested()
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    assert fp8.emulation_requested()


def test_a_missing_torchao_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"pip install torchao==0\.18\.0"):
        fp8.Float8Matmul("e4m3", "tensorwise")


def test_unknown_formats_and_recipes_are_refused():
    with pytest.raises(ValueError, match="tensorwise"):
        fp8.Float8Matmul("e4m3", "delayed")
    with pytest.raises(ValueError, match="hybrid"):
        fp8.Float8Matmul("e5m2", "tensorwise")
