"""The planner's multi-latent attention (megatron/planning/mla.py) against what one MLA layer
really holds: its parameters, the bytes autograd keeps for backward in the attention (within
5%, with and without a query latent, selective recompute; fp32 on the CPU) and the engine's KV
cache per token."""

from __future__ import annotations

import pytest
import torch

from megatron import mpu
from megatron.inference.engine import InferenceModel
from megatron.model.context import BuildContext
from megatron.model.memory import SavedActivations
from megatron.model.transformer import TransformerLayer
from megatron.models.gpt.model import GPTModel
from megatron.planning import mla
from megatron.planning.memory import Device, Layout, Training, layer_activation_bytes, layer_params
from tests.helpers.models import LLAMA, mla_fields, tiny_gpt

_BASE = dict(hidden_size=128, seq_length=64, **LLAMA)


def _cfg(**overrides):
    base = dict(**_BASE, num_attention_heads=4, **mla_fields(48, 32, 32, 16, 24))
    return tiny_gpt(**{**base, **overrides})


@pytest.mark.parametrize("q_lora_rank", [48, None])
@pytest.mark.parametrize("selective", [False, True])
def test_planner_mla_matches_what_the_attention_holds(q_lora_rank, selective):
    cfg = _cfg(q_lora_rank=q_lora_rank)
    layer = TransformerLayer(cfg, BuildContext(seed=1))
    attention = layer.self_attention
    attention.recompute_core = selective
    assert layer_params(cfg, tp=1) == sum(p.numel() for p in layer.parameters())
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    with SavedActivations(exclude=[x, *attention.parameters()]) as saved:
        attention(x)
    predicted = mla.activation_bytes(cfg, 2 * cfg.seq_length, 1, 1, 4, core=not selective)
    assert predicted == pytest.approx(saved.bytes, rel=0.05)
    # the layer's estimate takes MLA's in place of the query/key/value and core terms
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=2, num_micro_batches=1)
    twin = tiny_gpt(**{**_BASE, "num_attention_heads": 4})
    t, dev = Training(dtype_bytes=4), Device(mask_bytes=4)
    whole = layer_activation_bytes(cfg, lay, t, dev, core=not selective)
    dense = layer_activation_bytes(twin, lay, t, dev, core=False)
    gqa = 4 * 2 * cfg.seq_length * 4 * 32 * 4  # its q, k, v, ctx: 4 x (b s) x h x D
    assert whole - predicted == dense - gqa


def test_planner_kv_cache_bytes_are_the_engines():
    cfg = _cfg(num_layers=3)
    model = GPTModel(cfg, BuildContext(seed=1))
    engine = InferenceModel([model], mpu.single_process_state(), cfg.vocab_size, cfg.hidden_size)
    caches = engine.new_caches(1, 10)
    held = sum(c.k.nbytes + c.v.nbytes for c in caches.values()) // 10
    assert mla.kv_cache_bytes_per_token(cfg, 4) == held == 3 * (32 + 16) * 4
    gqa = tiny_gpt(num_layers=3, hidden_size=128, num_attention_heads=4, num_query_groups=2)
    assert mla.kv_cache_bytes_per_token(gqa, 2, tp=2) == 3 * 2 * 1 * 32 * 2


def test_mla_flops_are_what_torch_counts():
    """The explicit (unfused) attention, whose matmuls torch's counter sees."""
    import dataclasses

    from torch.utils.flop_counter import FlopCounterMode

    from megatron.fused_kernels import TORCH_OPS

    ctx = BuildContext(seed=1, ops=dataclasses.replace(TORCH_OPS, attention_backend="unfused"))
    for q_lora_rank in (48, None):
        cfg = _cfg(q_lora_rank=q_lora_rank)
        attention = TransformerLayer(cfg, ctx).self_attention
        x = torch.randn(1, cfg.seq_length, cfg.hidden_size)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            attention(x)
        assert mla.attention_flops(cfg, cfg.seq_length) == counter.get_total_flops()


def test_planner_time_model_counts_mla_flops():
    from megatron.planning.memory import mlp_params
    from megatron.planning.timing import layer_forward_flops

    cfg = _cfg()
    s = cfg.seq_length
    mat, core = layer_forward_flops(cfg, micro_batch=1)
    latent_norms = cfg.q_lora_rank + cfg.kv_lora_rank  # RMSNorm weights, not matmuls
    mlp = 2 * s * mlp_params(cfg, cfg.ffn_size, 1)
    assert mat + core == mla.attention_flops(cfg, s) + mlp + 2 * s * latent_norms
