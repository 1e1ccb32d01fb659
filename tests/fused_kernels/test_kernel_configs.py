"""The autotuned kernels under the configs a GPU may pick, in Triton's CPU interpreter.

The interpreter runs one config per kernel (timing configs there would mean nothing); these
tests swap in others, as the GPU's autotuner would, and check the pruning that decides which
configs a GPU times at each row width.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="the fused kernels need Triton")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)

from megatron.fused_kernels import _triton  # noqa: E402
from megatron.fused_kernels import triton_activations as act  # noqa: E402
from megatron.fused_kernels import triton_norms as norms  # noqa: E402
from tests.fused_kernels.compare import check_against_float64  # noqa: E402

NORM_KERNELS = (norms._norm_fwd_kernel, norms._norm_bwd_kernel)
ACT_KERNELS = (
    act._bias_gelu_fwd_kernel,
    act._bias_gelu_bwd_kernel,
    act._swiglu_fwd_kernel,
    act._swiglu_bwd_kernel,
)


def _use(monkeypatch, kernels, warps, **meta):
    for kernel in kernels:
        monkeypatch.setattr(kernel, "configs", [triton.Config(meta, num_warps=warps)])
        monkeypatch.setattr(kernel, "cache", {})


def _norm_inputs(dtype, rows, cols):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.5 * torch.randn(cols, generator=g)).to(dtype)
    return x, r, w, (0.5 * torch.randn(cols, generator=g)).to(dtype)


@pytest.mark.parametrize("rows_per_step", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_under_each_rows_per_program(monkeypatch, rows_per_step, dtype):
    # 37 rows: ragged last forward tile; backward chunks of 10 rows, walked rows_per_step at a time
    _use(monkeypatch, NORM_KERNELS, 8, ROWS=rows_per_step)
    x, r, w, b = _norm_inputs(dtype, 37, 100)
    check_against_float64(
        lambda *t: norms.fused_add_layer_norm(*t, 1e-5),
        lambda *t: norms.torch_add_layer_norm(*t, 1e-5),
        [x, r, w, b],
        dtype,
    )
    check_against_float64(
        lambda *t: norms.fused_add_rms_norm(*t, 1e-5),
        lambda *t: norms.torch_add_rms_norm(*t, 1e-5),
        [x, r, w],
        dtype,
    )


@pytest.mark.parametrize("block_r", [1, 8, 32])
def test_activations_under_each_rows_per_tile(monkeypatch, block_r):
    _use(monkeypatch, ACT_KERNELS, 4, BLOCK_R=block_r)
    monkeypatch.setattr(act, "MAX_BLOCK", 64)  # 100 columns: two column blocks, one ragged
    x, b = 2 * torch.randn(37, 100), torch.randn(100)
    check_against_float64(act.bias_gelu, act.torch_bias_gelu, [x, b], torch.float32)
    check_against_float64(
        lambda x, b: act.bias_gelu(x, b, "tanh"),
        lambda x, b: act.torch_bias_gelu(x, b, "tanh"),
        [x, b],
        torch.float32,
    )
    check_against_float64(act.swiglu, act.torch_swiglu, [torch.randn(37, 200)], torch.float32)


def _meta(kernel, width):
    if kernel in NORM_KERNELS:
        return {"BLOCK_N": triton.next_power_of_2(width)}
    return {"BLOCK_C": min(triton.next_power_of_2(width), act.MAX_BLOCK)}


@pytest.mark.parametrize("kernel", NORM_KERNELS + ACT_KERNELS, ids=lambda k: k.fn.__name__)
@pytest.mark.parametrize("width", [1, 33, 768, 1024, 2048, 3072, 8192, 16384])
def test_gpu_configs_pruned_to_a_register_budget(kernel, width):
    """What the GPU times at each width: never nothing, at most 32 values a thread (16 where a
    loop keeps accumulators), and at least 4 where the row is wide enough to allow it."""
    configs = kernel.gpu_prune(kernel.gpu_configs, {}, **_meta(kernel, width))
    assert configs and set(map(id, configs)) <= set(map(id, kernel.gpu_configs))
    rows = [c.kwargs.get("ROWS", c.kwargs.get("BLOCK_R")) for c in configs]
    block = next(iter(_meta(kernel, width).values()))
    per_thread = [r * block / (32 * c.num_warps) for r, c in zip(rows, configs, strict=True)]
    loops = kernel in (norms._norm_bwd_kernel, act._bias_gelu_bwd_kernel)
    assert max(per_thread) <= (16 if loops else 32) or len(configs) == 1, per_thread
    if block >= 1024:
        assert min(per_thread) >= 4, per_thread


@pytest.mark.parametrize("kernel", NORM_KERNELS + ACT_KERNELS, ids=lambda k: k.fn.__name__)
def test_without_autotuning_each_width_gets_one_fixed_config(monkeypatch, kernel):
    monkeypatch.setattr(_triton, "AUTOTUNE", False)
    for width in (33, 768, 3072, 16384):
        first, again = (
            kernel.gpu_prune(kernel.gpu_configs, {}, **_meta(kernel, width)) for _ in "ab"
        )
        assert len(first) == 1 and first[0] is again[0]


def test_bounded_configs_falls_back_to_the_nearest_config():
    configs = [triton.Config({"R": r}, num_warps=4) for r in (1, 2)]
    tiny = _triton.bounded_configs(configs, lambda c: c.kwargs["R"], per_thread=(4, 8))
    huge = _triton.bounded_configs(configs, lambda c: 10**6 * c.kwargs["R"], per_thread=(4, 8))
    assert [c.kwargs["R"] for c in tiny + huge] == [2, 1]


def test_rows_wider_than_max_cols_take_the_torch_twin(monkeypatch):
    monkeypatch.setattr(norms, "MAX_COLS", 64)
    x, r, w, b = _norm_inputs(torch.float32, 5, 100)
    y, h = norms.fused_add_layer_norm(x, r, w, b, 1e-5)
    want_y, want_h = norms.torch_add_layer_norm(x, r, w, b, 1e-5)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
    y, _ = norms.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(y, norms.torch_add_rms_norm(x, r, w, 1e-5)[0])


def test_reduction_programs_on_the_cpu_are_a_few():
    assert _triton.reduction_programs(torch.device("cpu"), per_sm=2) == 4
