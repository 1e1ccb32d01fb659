"""The memory model against what a built model saves for backward (planning and MoE tests)."""

from __future__ import annotations

import torch

from megatron.config.schema import ModelConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.fused_kernels import select_ops
from megatron.model.context import BuildContext
from megatron.model.memory import SavedActivations
from megatron.models.gpt.model import GPTModel
from megatron.planning.memory import Device, Layout, Training
from megatron.planning.pipeline_memory import stage_activation_peak


def saved_and_predicted_activations(m: ModelConfig, ce_impl: str = "native") -> tuple[int, int]:
    """(bytes the built model saves for backward, the memory model's prediction) for one
    micro batch of 2 sequences on one fp32 CPU process (`ce_impl`: --cross-entropy-fusion-impl)."""
    ops = select_ops(KernelConfig(cross_entropy_fusion_impl=ce_impl), "cpu")
    model = GPTModel(m, BuildContext(seed=1, ops=ops))
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length + 1))
    with SavedActivations(exclude=model.parameters()) as saved:
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    lay = Layout(1, 1, 1, micro_batch=2, num_micro_batches=1)
    cpu = Device(mask_bytes=4, flash_attention=False)
    t = Training(dtype_bytes=4, cross_entropy_fusion_impl=ce_impl)
    predicted = stage_activation_peak(m, lay, t, cpu, 0)["activations"]
    return saved.bytes, predicted
