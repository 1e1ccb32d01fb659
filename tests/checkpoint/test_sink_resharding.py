"""A learnable-sink, windowed model's checkpoint (--softmax-type learnable: one logit per head,
split over TP with the heads) written at TP 2 x PP 2 reads back as the model's full state and,
resharded to TP 1, computes the model's logits."""

from __future__ import annotations

import dataclasses

import torch

from megatron.checkpoint.reading import load_shard
from megatron.checkpoint.resharding import load_full_state, save_resharded
from tests.helpers.checkpoints import (
    VARIANTS,
    _logits,
    _model,
    _unpadded,
    _write_checkpoint,
)

CFG = dataclasses.replace(
    VARIANTS["llama"], window_size="3,0", window_attn_skip_freq="2", softmax_type="learnable"
)


def test_the_sink_logits_reshard_with_the_heads(tmp_path):
    model = _model(CFG)
    _write_checkpoint(tmp_path / "src", model, CFG, tp=2, pp=2)
    state, args = load_full_state(str(tmp_path / "src"))
    want = _unpadded(model, CFG)
    assert state.keys() == want.keys()
    assert all(torch.equal(state[n], t) for n, t in want.items())
    sinks = [n for n in state if n.endswith("core.softmax_offset")]
    assert len(sinks) == CFG.num_layers and state[sinks[0]].shape == (CFG.num_attention_heads,)
    save_resharded(state, args, str(tmp_path / "tp1"), 1, 1, 0, quiet=True)
    ours = _model(CFG, seed=11)
    ours.load_state_dict(
        load_shard(str(tmp_path / "tp1"), 0, tp_rank=0, pp_rank=0, pp_size=1)["model"]
    )
    torch.testing.assert_close(_logits(ours, CFG), _logits(model, CFG), rtol=0, atol=0)
