"""Layer kinds are one registry: a kind registered from this file alone (an MLP-only layer with
a scaled residual) builds in a GPT whose pattern mixes it with attention + MLP and attention +
MoE, lands where the pattern says, trains, and with scale 0 is the model without it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from megatron.config.layer_pattern import ATTENTION_MLP, ATTENTION_MOE, layer_kinds
from megatron.model.attention.masks import CAUSAL
from megatron.model.context import BuildContext
from megatron.model.layer_kinds import (
    attention_feed_forward,
    check_layer_kinds,
    register_layer_kind,
)
from megatron.model.mlp import ParallelMLP
from megatron.model.moe import MoELayer
from megatron.model.norms import build_norm
from megatron.model.transformer import TransformerLayer
from megatron.models.gpt.model import GPTModel
from tests.helpers.models import tiny_gpt


class MLPOnlyLayer(nn.Module):
    """x + scale * mlp(norm(x)): no attention."""

    def __init__(self, cfg, ctx: BuildContext, scale: float):
        super().__init__()
        self.scale = scale
        self.input_layernorm = build_norm(cfg, ctx.device, ctx.dtype)
        self.mlp = ParallelMLP(cfg, ctx)

    def forward(self, x, position_ids=None, kv_cache=None, attention_mask=CAUSAL):
        return x + self.scale * self.mlp(self.input_layernorm(x))


@dataclass(frozen=True)
class MLPOnly:
    scale: float

    def build(self, cfg, ctx: BuildContext, layer_number: int) -> nn.Module:
        return MLPOnlyLayer(cfg, ctx, self.scale)


MLP_ONLY, IDENTITY = "test-mlp-only", "test-mlp-only-x0"
register_layer_kind(MLP_ONLY, MLPOnly(1.0))
register_layer_kind(IDENTITY, MLPOnly(0.0))

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
DT = torch.float64


def _tokens(cfg):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)


def test_a_registered_kind_goes_where_the_pattern_says_and_trains():
    cfg = tiny_gpt(num_layers=4, moe_layer_freq="[0,0,1,0]", **MOE)
    assert layer_kinds(cfg) == (ATTENTION_MLP, ATTENTION_MLP, ATTENTION_MOE, ATTENTION_MLP)
    kinds = (ATTENTION_MLP, MLP_ONLY, ATTENTION_MOE, MLP_ONLY)
    model = GPTModel(cfg, BuildContext(seed=2, dtype=DT), kinds=kinds)
    layers = [model.layers[str(i)] for i in range(4)]
    assert [type(m).__name__ for m in layers] == [
        "TransformerLayer",
        "MLPOnlyLayer",
        "TransformerLayer",
        "MLPOnlyLayer",
    ]
    assert isinstance(layers[0].mlp, ParallelMLP) and isinstance(layers[2].mlp, MoELayer)
    # a pipeline stage holds its layers' kinds, under the same names
    stage = GPTModel(cfg, BuildContext(seed=2, dtype=DT), layer_range=range(2, 4), kinds=kinds)
    assert [type(m).__name__ for m in stage.run_order()] == ["TransformerLayer", "MLPOnlyLayer"]
    torch.testing.assert_close(
        stage.layers["3"].mlp.dense_h_to_4h.weight, layers[3].mlp.dense_h_to_4h.weight
    )
    tokens = _tokens(cfg)
    loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.layers.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_the_kind_as_identity_is_the_model_without_that_layer():
    cfg = tiny_gpt(num_layers=3, moe_layer_freq="[0,0,1]", **MOE)
    ctx = BuildContext(seed=4, dtype=DT)
    model = GPTModel(cfg, ctx, kinds=(ATTENTION_MLP, IDENTITY, ATTENTION_MOE)).eval()
    without = GPTModel(tiny_gpt(num_layers=2, moe_layer_freq="[0,1]", **MOE), ctx).eval()
    state = {
        k.replace("layers.2.", "layers.1."): v
        for k, v in model.state_dict().items()
        if not k.startswith("layers.1.")
    }
    without.load_state_dict(state)
    tokens = _tokens(cfg)
    torch.testing.assert_close(model(tokens), without(tokens), rtol=0, atol=0)


def test_kinds_are_refused_by_name_and_count():
    cfg = tiny_gpt(num_layers=2)
    with pytest.raises(ValueError, match=r"no layer kind 'mamba'; registered: attention\+mlp"):
        GPTModel(cfg, kinds=(ATTENTION_MLP, "mamba"))
    with pytest.raises(ValueError, match="3 layer kinds for --num-layers 2"):
        check_layer_kinds((ATTENTION_MLP,) * 3, cfg)
    with pytest.raises(ValueError, match="already registered"):
        register_layer_kind(ATTENTION_MLP, MLPOnly(1.0))
    # DeepSpeed's pipeline layers subclass TransformerLayer: attention kinds only
    assert attention_feed_forward(ATTENTION_MOE) is MoELayer
    with pytest.raises(ValueError, match="not attention \\+ a feed-forward block"):
        attention_feed_forward(MLP_ONLY)
    assert isinstance(GPTModel(cfg).layers["1"], TransformerLayer)
