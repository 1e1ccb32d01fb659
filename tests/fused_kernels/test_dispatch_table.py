"""The dispatch follows the measured kernel table: on CUDA, add + LayerNorm and bias + GeLU run
torch's ops (our kernels measured slower there, forward + backward), add + RMSNorm, SwiGLU and
the cross-entropy run ours; `follow_table=False` (the kernels' own CUDA tests) keeps ours.
Checked on the CPU by letting Triton 'run' (every self-check passing) on a device called cuda."""

import dataclasses

import pytest
import torch

from megatron import fused_kernels
from megatron.config.schema import ModelConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.fused_kernels import SLOWER_THAN_TORCH, FusedOps, checks, select_ops
from megatron.model.context import BuildContext
from megatron.model.transformer import TransformerLayer


@pytest.fixture
def kernels_run_everywhere(monkeypatch):
    monkeypatch.setattr(fused_kernels, "triton_available", lambda device: True)
    passing = {impl: {op: (lambda device: True) for op in t} for impl, t in checks.CHECKS.items()}
    monkeypatch.setattr(checks, "CHECKS", passing)


def test_on_cuda_the_table_keeps_torch_where_ours_measured_slower(kernels_run_everywhere):
    assert SLOWER_THAN_TORCH["cuda"] == {"add_layer_norm", "bias_gelu"}
    ops = select_ops(KernelConfig(), "cuda")
    assert (ops.bias_gelu, ops.swiglu, ops.cross_entropy) == ("torch", "triton", "triton")
    assert ops.add_norm_impl(rms=True) == "triton" and ops.add_norm_impl(rms=False) == "torch"
    assert "add+norm = triton (LayerNorm: torch, measured faster here)" in ops.describe()
    ours = select_ops(KernelConfig(), "cuda", follow_table=False)
    assert ours.add_norm_impl(rms=False) == "triton" and ours.bias_gelu == "triton"


def test_elsewhere_the_table_changes_nothing(kernels_run_everywhere):
    ops = select_ops(KernelConfig(), "cpu")
    assert ops.bias_gelu == "triton" and ops.add_norm_impl(rms=False) == "triton"


@pytest.mark.parametrize("normalization, fused", [("LayerNorm", False), ("RMSNorm", True)])
def test_the_layer_fuses_the_add_only_where_the_table_says(normalization, fused, monkeypatch):
    """The layer asks the ops for its own norm: with LayerNorm kept on torch it never calls the
    add + norm kernel; with RMSNorm it does."""
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        max_position_embeddings=8,
        vocab_size=64,
        normalization=normalization,
    )
    ops = dataclasses.replace(FusedOps(), add_norm="triton", add_layer_norm_impl="torch")
    layer = TransformerLayer(cfg, BuildContext(ops=ops))
    called = []
    monkeypatch.setattr(layer, "_add_norm", lambda x, r: called.append(1) or (x + r, x + r))
    layer(torch.randn(2, 8, 32))
    assert bool(called) is fused
