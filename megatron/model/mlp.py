"""The dense MLP of a transformer layer, TP-split: h -> ffn -> h.

dense_h_to_4h is column-parallel and dense_4h_to_h row-parallel, so the block does one
all-reduce forward (the row-parallel sum) and one backward (the column-parallel input's
gradient); with sequence parallelism an all-gather and a reduce-scatter of the sequence instead.
Its own module because both the layer (model/transformer.py, the kind attention + MLP of
model/layer_kinds.py) and the MoE's shared expert (model/moe.py) build it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(nn.Module):
    """h -> ffn (GeLU, or SwiGLU: silu(gate) * up) -> h, the ffn dimension split over TP."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.swiglu, self.ops = cfg.swiglu, ctx.ops
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"  # --openai-gelu
        kw = {
            "group": state.tp_group,
            "bias": cfg.add_bias_linear,
            "init_method": None,
            "sequence_parallel": state.sequence_parallel,
            "device": device,
            "dtype": dtype,
        }
        # SwiGLU stacks [gate; up] in one weight; stride 2 gives each rank [gate_r; up_r].
        self.dense_h_to_4h = ColumnParallelLinear(
            cfg.hidden_size,
            cfg.ffn_size * (2 if cfg.swiglu else 1),
            stride=2 if cfg.swiglu else 1,
            **kw,
        )
        self.dense_4h_to_h = RowParallelLinear(
            cfg.ffn_size, cfg.hidden_size, input_is_parallel=True, **kw
        )
        self.defer_bias = self.ops.bias_dropout_add == "compile" and cfg.add_bias_linear

    @property
    def deferred_bias(self) -> torch.Tensor | None:
        """The output bias `forward` leaves to the layer's fused bias-dropout-add."""
        return self.dense_4h_to_h.bias if self.defer_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1 = self.dense_h_to_4h
        if self.swiglu:
            y = self.ops.swiglu_act(fc1(x))  # [gate; up] -> silu(gate) * up
        elif self.ops.bias_gelu == "triton" and fc1.bias is not None:
            y = self.ops.gelu_with_bias(fc1.forward_without_bias(x), fc1.bias, self.gelu_approx)
        else:
            y = F.gelu(fc1(x), approximate=self.gelu_approx)
        if self.defer_bias:  # --bias-dropout-fusion: the layer adds the bias in its fused op
            return self.dense_4h_to_h.forward_without_bias(y)
        return self.dense_4h_to_h(y)
