"""MoE checkpoints through conversion: TP x PP resharding, and Hugging Face MixtralForCausalLM
and Qwen2MoeForCausalLM export (equal logits in transformers) and import."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.checkpoint.reading import load_shard
from megatron.checkpoint.resharding import load_full_state, model_config, save_resharded
from tests.helpers.checkpoints import (
    VARIANTS,
    _logits,
    _model,
    _tokens,
    _unpadded,
    _write_checkpoint,
)

# The Llama variant of the conversion tests (RoPE, RMSNorm, SwiGLU, GQA 8 / 4, untied, no
# biases) with 4 experts of width 24, top-2.
_MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
MOE = {
    "mixtral": dataclasses.replace(VARIANTS["llama"], **_MOE),
    "qwen2_moe": dataclasses.replace(
        VARIANTS["llama"],
        **_MOE,
        ffn_hidden_size=40,  # the dense layers' MLP
        moe_layer_freq=2,
        moe_router_pre_softmax=True,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
    ),
}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def test_moe_checkpoints_reshard_over_tp_and_pp(tmp_path):
    cfg = MOE["qwen2_moe"]
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=2, pp=2)
    state, _ = load_full_state(str(tmp_path / "src"))
    assert all(torch.equal(state[n], t) for n, t in _unpadded(model, cfg).items())


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MOE))
def test_moe_exports_give_the_same_logits_in_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers", reason="HF export checks need transformers")
    from megatron.models.gpt.hf import to_hf

    cfg = MOE[arch]
    model = _model(cfg)
    _write_checkpoint(tmp_path / "src", model, cfg, tp=2, pp=1)
    state, args = load_full_state(str(tmp_path / "src"))
    assert to_hf(state, args, str(tmp_path / "hf")) == arch
    cls = getattr(transformers, CLASSES[arch])
    hf, info = cls.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        theirs = hf.eval()(_tokens(cfg)).logits
    torch.testing.assert_close(theirs, _logits(model, cfg), rtol=1e-5, atol=1e-5)
    # and back: the Hub layout we wrote is read into the same tensors
    from megatron.models.gpt.hf import from_hf

    back, back_args = from_hf(str(tmp_path / "hf"))
    assert model_config(back_args).moe_layers == cfg.moe_layers
    assert all(torch.equal(back[n], t) for n, t in state.items())


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MOE))
def test_moe_imports_read_what_transformers_writes(tmp_path, arch):
    """transformers 5 saves its fused expert layout; the import computes the same logits."""
    transformers = pytest.importorskip("transformers", reason="HF import checks need transformers")
    from megatron.models.gpt.hf import from_hf

    cfg = MOE[arch]
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups,
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=1e-5,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=4)
    else:
        config = transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=40,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=16,
            num_experts=4,
            mlp_only_layers=[1, 3],
            qkv_bias=False,
        )
    hf = getattr(transformers, CLASSES[arch])(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    hf.save_pretrained(str(tmp_path / "hf"))
    state, args = from_hf(str(tmp_path / "hf"))
    ours_cfg = model_config(args)
    assert ours_cfg.num_experts == 4 and ours_cfg.moe_layers == cfg.moe_layers
    assert ours_cfg.moe_router_pre_softmax == (arch == "qwen2_moe")
    save_resharded(state, args, str(tmp_path / "ck"), 1, 1, 0, quiet=True)
    ours = _model(ours_cfg, seed=11)
    ours.load_state_dict(
        load_shard(str(tmp_path / "ck"), 0, tp_rank=0, pp_rank=0, pp_size=1)["model"]
    )
    tokens = _tokens(ours_cfg)
    with torch.no_grad():
        expected = hf.eval()(tokens).logits
        torch.testing.assert_close(
            ours(tokens)[..., : cfg.vocab_size], expected, rtol=1e-5, atol=1e-5
        )


def test_moe_exports_refuse_what_hf_cannot_compute():
    from megatron.models.gpt.hf import hf_architecture

    capacity = dataclasses.replace(MOE["mixtral"], moe_expert_capacity_factor=1.0)
    with pytest.raises(ValueError, match="no --moe-expert-capacity-factor"):
        hf_architecture(capacity)
    ungated = dataclasses.replace(MOE["qwen2_moe"], moe_shared_expert_gate=False)
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM would need"):
        hf_architecture(ungated)
