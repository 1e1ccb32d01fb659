"""--fp8-format: the transformer layers' linears compute their GEMMs in float8.

Which linears: every ColumnParallelLinear / RowParallelLinear inside a transformer layer (the
QKV and attention-output projections, both MLP projections) whose local weight shard
(out / p, in) or (out, in / p) has both dimensions multiples of 16, as float8 GEMMs need;
others stay bf16 and are named in the log line. The embedding and the output head stay bf16
(as Megatron-core and torchtitan keep them: the logits' error would reach every token's loss),
and so do norms, attention's softmax(q k^T) v, the loss and the weights themselves.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron.config.declare import ConfigError
from megatron.config.schema import PrecisionConfig
from megatron.model.transformer import TransformerLayer
from megatron.mpu.fp8 import (
    ALIGNMENT,
    Float8Matmul,
    device_problem,
    emulation_requested,
    import_torchao_float8,
)
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear


@dataclasses.dataclass
class Fp8Report:
    """What apply_fp8 did: the linears now in float8 and those kept in bf16 (with why)."""

    matmul: Float8Matmul
    converted: list[str]
    kept: list[str]

    def describe(self) -> str:
        kept = f"; kept in bf16 (a dim not a multiple of {ALIGNMENT}): {', '.join(self.kept)}"
        return (
            f"> fp8 ({self.matmul.fp8_format}): {len(self.converted)} linears in "
            f"{self.matmul.describe()} via torchao; embedding, output head, norms, attention "
            f"and weights stay bf16{kept if self.kept else ''}"
        )


def apply_fp8(
    model: nn.Module, precision: PrecisionConfig, emulate: bool | None = None
) -> Fp8Report | None:
    """Give the transformer layers' linears of `model` (built, on its device) a Float8Matmul
    for `precision.fp8_format` / `fp8_recipe`; None when fp8 is off. `emulate` (default: the
    MEGATRON_FP8_EMULATE environment variable, for tests): float8 rounding, fp32 GEMMs.
    Raises ConfigError when this device cannot take it; `precision` has passed
    megatron.config.rules_fp8 (--bf16 weights, no experts)."""
    if precision.fp8_format is None:
        return None
    emulate = emulation_requested() if emulate is None else emulate
    _check(model, precision, emulate)
    matmul = Float8Matmul(precision.fp8_format, precision.fp8_scaling, emulate)
    report = Fp8Report(matmul, [], [])
    for prefix, layer in model.named_modules():
        if not isinstance(layer, TransformerLayer):
            continue
        for name, module in layer.named_modules(prefix=prefix):
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                out, inp = module.weight.shape  # this rank's shard
                fits = out % ALIGNMENT == 0 and inp % ALIGNMENT == 0
                module.fp8 = matmul if fits else None
                (report.converted if fits else report.kept).append(
                    name if fits else f"{name} ({out} x {inp})"
                )
    return report


def _check(model: nn.Module, precision: PrecisionConfig, emulate: bool) -> None:
    """What only the run time shows: float8 GEMMs on the model's device, torchao installed.
    The flags (--bf16, no experts, the recipe) are megatron.config.rules_fp8's to refuse."""
    flag = f"--fp8-format {precision.fp8_format}"
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    problem = device_problem(device, emulate)
    if problem is not None:
        raise ConfigError(f"{flag}: {problem}. Fix: drop --fp8-format on this device")
    try:
        import_torchao_float8()
    except ImportError as e:
        raise ConfigError(str(e)) from None
