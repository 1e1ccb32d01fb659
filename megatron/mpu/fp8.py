"""Float8 GEMMs for the tensor-parallel linears, through torchao's float8 training.

Y = X W^T is computed as (s_x X8)(s_w W8)^T: X and W are cast to float8 e4m3 with scales
s = amax / 448 taken from the tensor itself at every call (dynamic, "current" scaling), one per
tensor (`tensorwise`, cuBLAS's fp8 GEMM) or one per row of the GEMM operand (`rowwise`, CUTLASS's,
scales rounded down to powers of two). Backward: dL/dX = dL/dY W and dL/dW = dL/dY^T X, with
dL/dY cast to e4m3 (--fp8-format e4m3) or e5m2 (hybrid: three more exponent bits of range for
gradients, one less mantissa bit). Each GEMM accumulates in fp32 and returns the input's dtype.
The weights stay what they are (bf16, fp32 masters in the optimizer): only GEMM operands are
cast, so checkpoints do not change.

Scales come from this rank's operands: a tensor-parallel shard is scaled on its own (finer than
one scale for the whole tensor), so TP > 1 equals TP = 1 within float8 rounding, not exactly.

torchao is imported here only, and only when fp8 is asked for (`pip install torchao==0.18.0`,
the `fp8` extra). Its autograd function `matmul_with_hp_or_float8_args` does the casts and the
scaled GEMMs; our layers keep their TP collectives around it.
"""

from __future__ import annotations

import os

import torch

TORCHAO_REQUIREMENT = "torchao==0.18.0"
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise")
# Tests only: "1" runs the float8 casts (the same rounding) with the GEMMs in fp32, so the CPU
# can check the numerics (torchao's `emulate`). Not a flag: emulation is never faster.
EMULATE_ENV = "MEGATRON_FP8_EMULATE"
ALIGNMENT = 16  # float8 GEMMs need both dims of each operand to be multiples of 16
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have float8 tensor cores


def emulation_requested() -> bool:
    return os.environ.get(EMULATE_ENV) == "1"


def import_torchao_float8():
    """torchao's float8 module, or an ImportError that names the package to install."""
    try:
        import torchao.float8 as float8
        from torchao.float8 import float8_linear
    except ImportError as e:
        raise ImportError(
            f"--fp8-format needs torchao's float8 training, which did not import ({e}). "
            f"Fix: pip install {TORCHAO_REQUIREMENT} (or drop --fp8-format)"
        ) from e
    return float8, float8_linear


def device_problem(device: torch.device, emulate: bool = False) -> str | None:
    """Why `device` cannot run float8 GEMMs (None: it can, or emulation is asked for)."""
    if emulate:
        return None
    if device.type != "cuda":
        return f"the {device.type} has no float8 matmul (a CUDA GPU of compute capability 8.9+ has)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} (compute capability {major}.{minor}) has no float8 matmul; it needs "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (L4/L40, H100, B200)"
        )
    return None


class _Ctx:
    """The ctx torchao's autograd function writes in forward and reads in backward; lets
    _GatheredLinear (megatron.mpu.layers) run its math between our own sequence gathers."""

    def __init__(self, mm_config, config, saved=()):
        self.linear_mm_config, self.config, self.saved_tensors = mm_config, config, saved

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class Float8Matmul:
    """X W^T (+ b) in float8 for one format and recipe; what a TP linear's `fp8` slot holds."""

    def __init__(self, fp8_format: str, recipe: str, emulate: bool = False):
        if fp8_format not in FP8_FORMATS:
            raise ValueError(f"fp8 format {fp8_format!r}: use one of {FP8_FORMATS}")
        if recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {recipe!r}: use one of {FP8_RECIPES}")
        float8, float8_linear = import_torchao_float8()
        self.fp8_format, self.recipe, self.emulate = fp8_format, recipe, emulate
        self._function = float8_linear.matmul_with_hp_or_float8_args
        gran = float8.ScalingGranularity
        granularity = gran.AXISWISE if recipe == "rowwise" else gran.TENSORWISE
        grad_dtype = torch.float8_e5m2 if fp8_format == "hybrid" else torch.float8_e4m3fn

        def cast(dtype):
            return float8.CastConfig(scaling_granularity=granularity, target_dtype=dtype)

        self.config = float8.Float8LinearConfig(
            cast_config_input=cast(torch.float8_e4m3fn),
            cast_config_weight=cast(torch.float8_e4m3fn),
            cast_config_grad_output=cast(grad_dtype),
            round_scales_to_power_of_2=recipe == "rowwise",  # as torchao's rowwise recipe
            emulate=emulate,
        )
        self._mm = {pad: self._mm_config(float8, pad) for pad in (False, True)}

    def _mm_config(self, float8, pad_tokens: bool):
        """The three GEMMs' settings (output, grad_input, grad_weight). dL/dW's inner dimension
        is the token count: padded to a multiple of 16 only for a call whose count is not."""
        c, mm = self.config, float8.ScaledMMConfig
        return float8.LinearMMConfig(
            mm(self.emulate, c.gemm_config_output.use_fast_accum, False, False),
            mm(self.emulate, c.gemm_config_grad_input.use_fast_accum, False, False),
            mm(self.emulate, c.gemm_config_grad_weight.use_fast_accum, False, pad_tokens),
        )

    def _mm_for(self, x: torch.Tensor):
        return self._mm[(x.numel() // x.size(-1)) % ALIGNMENT != 0]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        """X (..., in) W^T (+ b): W (out, in); differentiable (torchao's autograd function)."""
        y = self._function.apply(x, weight.t(), self._mm_for(x), self.config)  # (..., out)
        return y if bias is None else y + bias.to(y.dtype)

    def forward_mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """X W^T without autograd, for a caller that runs backward_mm itself."""
        ctx = _Ctx(self._mm_for(x), self.config)
        return self._function.forward(ctx, x, weight.t(), ctx.linear_mm_config, self.config)

    def backward_mm(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
        """(dL/dX, dL/dW) of forward_mm's X W^T for dL/dY = `grad` (..., out)."""
        ctx = _Ctx(self._mm_for(x), self.config, (x, weight.t()))
        grad_x, grad_weight_t, *_ = self._function.backward(ctx, grad)
        return grad_x, grad_weight_t.t()  # (..., in), (out, in)

    def describe(self) -> str:
        grads = "e5m2" if self.fp8_format == "hybrid" else "e4m3"
        how = "emulated: fp32 GEMMs of float8-rounded operands" if self.emulate else "GEMMs"
        return f"float8 {self.recipe} scaling, e4m3 operands, {grads} gradients ({how})"
