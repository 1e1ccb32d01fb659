"""MFU counts only the attention inside the window: a windowed layer (--window-size LEFT,0)
scores each query against LEFT + 1 keys in the logged FLOPs and the planner's, a global layer
against all s (Megatron's full-square convention); without a window nothing changes."""

from __future__ import annotations

import pytest

from megatron.planning.timing import layer_forward_flops, model_flops
from megatron.training.log import model_flops_per_sample
from tests.helpers.models import tiny_gpt, tiny_mla


@pytest.mark.parametrize("make", [tiny_gpt, tiny_mla])
def test_windowed_layers_count_their_window_of_keys(make):
    s = 16
    plain = make(seq_length=s, num_layers=4)
    windowed = make(seq_length=s, num_layers=4, window_size="3,0", window_attn_skip_freq="2")
    assert windowed.keys_per_query(s) == (4, s, 4, s)
    if plain.multi_latent_attention:  # scores over d_qk, weighted sum over d_v
        per_key = (
            2
            * s
            * plain.num_attention_heads
            * (plain.qk_nope_dim + plain.qk_rope_dim + plain.v_dim)
        )
    else:
        per_key = 4 * s * plain.num_attention_heads * plain.head_dim
    fewer = 2 * (s - 4) * per_key  # two windowed layers, s - 4 keys fewer per query
    assert model_flops_per_sample(plain, s) - model_flops_per_sample(windowed, s) == 3 * fewer
    core, core_windowed = (layer_forward_flops(m, 1)[1] for m in (plain, windowed))
    assert core_windowed == pytest.approx(core * (4 + s) / (2 * s))
    assert model_flops(plain, 1) - model_flops(windowed, 1) == pytest.approx(3 * fewer)
    assert plain.keys_per_query(s) == (s,) * 4
