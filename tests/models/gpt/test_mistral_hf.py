"""Hugging Face MistralForCausalLM (a sliding window on every layer): our windowed Llama exported
gives transformers' logits, transformers' Mistral imported gives ours, and what has no twin
(windows on some layers, sinks, a window dropped by another architecture) is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.checkpoint.resharding import load_full_state, model_config
from megatron.models.gpt.hf import from_hf, hf_architecture, to_hf
from tests.helpers.checkpoints import (
    VARIANTS,
    _logits,
    _model,
    _tokens,
    _write_checkpoint,
    model_from_full_state,
    save_jittered_hf,
)

MISTRAL = dataclasses.replace(VARIANTS["llama"], window_size="3,0")  # HF sliding_window 4


@pytest.mark.slow
def test_mistral_export_and_import_give_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers", reason="HF checks need transformers")
    cfg = MISTRAL
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=1, pp=1)
    state, args = load_full_state(str(tmp_path / "src"))
    assert to_hf(state, args, str(tmp_path / "hf")) == "mistral"
    hf, info = transformers.MistralForCausalLM.from_pretrained(
        str(tmp_path / "hf"), output_loading_info=True
    )
    assert hf.config.sliding_window == 4
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        theirs = hf.eval()(_tokens(cfg)).logits
    ours = _logits(model, cfg)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    global_model = _model(dataclasses.replace(cfg, window_size=None))
    assert not torch.allclose(_logits(global_model, cfg), ours, atol=1e-4)  # the window acts
    back, back_args = from_hf(str(tmp_path / "hf"))
    assert model_config(back_args).window == (3, 0)
    assert all(torch.equal(back[n], t) for n, t in state.items())


@pytest.mark.slow
def test_mistral_import_reads_what_transformers_writes(tmp_path):
    transformers = pytest.importorskip("transformers", reason="HF checks need transformers")
    config = transformers.MistralConfig(
        vocab_size=70,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16,
        sliding_window=5,
        tie_word_embeddings=False,
    )
    hf = transformers.MistralForCausalLM(config)
    save_jittered_hf(hf, str(tmp_path / "hf"))
    state, args = from_hf(str(tmp_path / "hf"))
    cfg = model_config(args)
    assert cfg.window == (4, 0) and all(cfg.window_layers)
    ours = model_from_full_state(state, args, str(tmp_path / "ck"))
    tokens = _tokens(cfg)
    with torch.no_grad():
        expected = hf.eval()(tokens).logits
        torch.testing.assert_close(ours(tokens)[..., :70], expected, rtol=1e-5, atol=1e-5)


def test_what_has_no_twin_is_refused_not_exported_without_it():
    some = dataclasses.replace(MISTRAL, window_attn_skip_freq="2")
    with pytest.raises(ValueError, match="windows on some layers only"):
        hf_architecture(some)
    with pytest.raises(ValueError, match="--softmax-type learnable: attention sinks"):
        hf_architecture(dataclasses.replace(VARIANTS["llama"], softmax_type="learnable"))
    gpt2 = dataclasses.replace(VARIANTS["gpt2"], window_size="3,0")  # GPT-2 takes no window
    with pytest.raises(ValueError, match="MistralForCausalLM would need"):
        hf_architecture(gpt2)
    assert hf_architecture(MISTRAL) == "mistral"
