"""Hugging Face DeepseekV3ForCausalLM both ways (megatron/models/gpt/hf_deepseek.py).

A tiny DeepSeek-V3-shaped GPT (multi-latent attention with and without a query latent, a dense
first layer, sigmoid-routed experts with a shared expert, the expert bias, group-limited
routing, the routed scaling factor, multi-token prediction) trained a few steps here, exported,
loaded by transformers: equal logits in fp32 and equal greedy tokens; its MTP depth equal to
transformers' MtpLayer on the exported weights; imported back to the same state. And a model
transformers built and saved, imported: equal logits, the MTP depth it announces but does not
save dropped with a note. No network: the configs are built here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.inference.engine import InferenceModel
from megatron.inference.generation import SamplingParams, generate
from megatron.model.attention.masks import CAUSAL
from megatron.model.context import BuildContext
from megatron.model.moe import moe_step_stats
from megatron.model.mtp import set_mtp_loss_scale
from megatron.models.gpt.hf import from_hf, to_hf
from megatron.models.gpt.model import GPTModel
from megatron.models.gpt.train import lm_loss
from tests.helpers.checkpoints import _args, _unpadded
from tests.helpers.models import tiny_deepseek

transformers = pytest.importorskip("transformers")

DENSE_FIELDS = (
    "num_layers hidden_size num_attention_heads ffn_hidden_size seq_length vocab_size "
    "make_vocab_size_divisible_by hidden_dropout attention_dropout position_embedding_type "
    "normalization layernorm_epsilon swiglu add_bias_linear untie_embeddings_and_output_weights "
    "multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim "
    "rope_type rotary_scaling_factor original_max_position_embeddings mscale_all_dim "
    "mtp_num_layers"
).split()
V3 = tiny_deepseek()
VARIANTS = {
    "v3": V3,
    # no query latent, plain RoPE, tied head, no group limit, two MTP depths
    "lite": dataclasses.replace(
        V3,
        q_lora_rank=None,
        rope_type="rope",  # no YaRN settings (refused with plain RoPE)
        rotary_scaling_factor=1.0,
        original_max_position_embeddings=4096,
        mscale_all_dim=0.0,
        untie_embeddings_and_output_weights=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk=2,
        moe_router_topk_scaling_factor=None,
        mtp_num_layers=2,
    ),
    # no experts at all: every layer within first_k_dense_replace
    "dense": ModelConfig(
        **{
            f.name: getattr(V3, f.name)
            for f in dataclasses.fields(ModelConfig)
            if f.name in DENSE_FIELDS
        }
    ),
}


def _tokens(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=g)


def _trained(cfg) -> GPTModel:
    """A few AdamW steps on random tokens, the MTP losses on, the expert bias moved after each."""
    model = GPTModel(cfg, BuildContext(seed=11))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_mtp_loss_scale(model, 1.0)
    for step in range(3):
        seq = _tokens(cfg, seed=step)
        mask = torch.ones(seq[:, 1:].shape)
        loss, _ = lm_loss(mask, model(seq[:, :-1], labels=seq[:, 1:], loss_mask=mask))
        opt.zero_grad()
        loss.backward()
        opt.step()
        moe_step_stats(model, mpu.single_process_state(), cfg)  # moves the expert biases
    if cfg.moe:
        assert model.layers["1"].mlp.router.expert_bias.abs().sum() > 0
    return model.eval()


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def _mtp_reference(hf_model, weights: dict, cfg, depth: int):
    """transformers' MtpLayer for `depth`, its weights read from the export's files."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    index = 99 if cfg.moe else 0  # a layer index past first_k_dense_replace: an MoE layer
    layer = MtpLayer(hf_model.config, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, index)
    prefix, sd = f"model.layers.{cfg.num_layers + depth}.", {}
    for name, t in weights.items():
        if not name.startswith(prefix) or "embed_tokens" in name or "shared_head.head" in name:
            continue
        rest = name[len(prefix) :]
        if rest.startswith(("enorm", "hnorm", "eh_proj")):
            sd[rest] = t
        elif rest.startswith("shared_head.norm"):
            sd["post_norm.weight"] = t
        elif ".experts." not in rest:
            sd["mtp_block." + rest] = t
    if not cfg.moe:
        layer.load_state_dict(sd)
        return layer.eval()
    e = "mlp.experts."
    expert = lambda i, n: weights[f"{prefix}{e}{i}.{n}_proj.weight"]  # noqa: E731
    experts = range(cfg.num_experts)
    gate_up = [torch.cat([expert(i, "gate"), expert(i, "up")]) for i in experts]
    sd[f"mtp_block.{e}gate_up_proj"] = torch.stack(gate_up)
    sd[f"mtp_block.{e}down_proj"] = torch.stack([expert(i, "down") for i in experts])
    layer.load_state_dict(sd)
    return layer.eval()


@pytest.mark.slow  # transformers' import and three models: seconds
@pytest.mark.parametrize("name", list(VARIANTS))
@torch.no_grad()
def test_trained_model_exports_to_transformers_and_back(tmp_path, name):
    cfg = VARIANTS[name]
    with torch.enable_grad():
        model = _trained(cfg)
    full = _unpadded(model, cfg)
    assert to_hf(full, _args(cfg, 1, 1), str(tmp_path)) == "deepseek_v3"
    hf = _hf_model(tmp_path)
    dense = 1 if cfg.moe else cfg.num_layers
    assert hf.config.first_k_dense_replace == dense
    assert hf.config.num_mtp_layers == cfg.mtp_num_layers
    tokens = _tokens(cfg)[:, :-1]
    ours = model(tokens)[..., : cfg.vocab_size]
    torch.testing.assert_close(hf(tokens).logits, ours, rtol=1e-4, atol=1e-5)

    prompts, params = [tokens[0, :5].tolist(), tokens[1, :5].tolist()], SamplingParams(8, True)
    engine = InferenceModel([model], mpu.single_process_state(), cfg.vocab_size, cfg.hidden_size)
    greedy = generate(engine, prompts, params, use_cache=True)
    prompt = tokens[:, :5]  # all real tokens (id 0 too): an explicit mask, no padding guessed
    mask = torch.ones_like(prompt)
    hf_greedy = hf.generate(
        prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert [g[5:] for g in hf_greedy.tolist()] == [g[-8:] for g in greedy]

    # each MTP depth: transformers' MtpLayer on the exported weights
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    x = model.embedding(tokens)
    for layer in model.run_order():
        x = layer(x)
    ours_h = hf_h = model.head.final_layernorm(x)  # h^0, also HF's last_hidden_state
    torch.testing.assert_close(hf.model(tokens).last_hidden_state, hf_h, rtol=1e-4, atol=1e-5)
    s = tokens.size(1)
    positions = torch.arange(s).expand(2, -1)
    weight = model.word_embeddings_weight()
    for k in range(cfg.mtp_num_layers):
        ahead = torch.roll(tokens, -(k + 1), dims=1)  # t_{i+k+1}; the wrapped tail compared not
        module = model.mtp.layers[k]
        ours_h = module(ours_h, model.embedding.words(ahead), positions, CAUSAL, None, None)
        reference = _mtp_reference(hf, weights, cfg, k)
        cos_sin = hf.model.rotary_emb(hf_h, positions)
        embeds = hf.model.embed_tokens(ahead)
        hf_h = reference(embeds, hf_h, cos_sin, None, positions, None)
        keep = slice(0, s - k - 1)
        want = hf.lm_head(hf_h)[:, keep]
        got = model.head.logits(ours_h, weight)[:, keep, : cfg.vocab_size]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"MTP depth {k + 1}")

    state, args = from_hf(str(tmp_path))  # and back: the same tensors
    assert args["model"]["mtp_num_layers"] == cfg.mtp_num_layers
    assert set(state) == set(full)
    for n, t in full.items():
        torch.testing.assert_close(state[n], t, rtol=0, atol=0, msg=n)


@pytest.mark.slow
@torch.no_grad()
def test_a_transformers_model_imports_with_equal_logits(tmp_path, capsys):
    hc = transformers.DeepseekV3Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        routed_scaling_factor=1.5,
        kv_lora_rank=8,
        q_lora_rank=12,
        qk_rope_head_dim=4,
        v_head_dim=6,
        qk_nope_head_dim=6,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # num_mtp_layers: 1 (announced; transformers saves no MTP weights)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hc).eval()
    for layer in hf.model.layers[2:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(str(tmp_path))
    state, args = from_hf(str(tmp_path))
    assert "imported with 0" in capsys.readouterr().err
    cfg = ModelConfig(**args["model"])
    assert cfg.mtp_num_layers is None and cfg.moe_layer_freq.replace(" ", "") == "([0]*2+[1]*1)"
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    model = GPTModel(cfg, BuildContext(seed=1)).eval()
    pad = cfg.padded_vocab_size(1) - cfg.vocab_size
    emb = state["embedding.word_embeddings.weight"]
    state["embedding.word_embeddings.weight"] = torch.cat([emb, emb.new_zeros(pad, 32)])
    state["head.output_layer.weight"] = torch.cat(
        [state["head.output_layer.weight"], emb.new_zeros(pad, 32)]
    )
    model.load_state_dict(state)
    tokens = torch.randint(0, 80, (2, 12), generator=torch.Generator().manual_seed(3))
    ours = model(tokens)[..., :80]
    torch.testing.assert_close(ours, hf(tokens).logits, rtol=1e-4, atol=1e-5)


def test_export_refuses_what_deepseek_v3_cannot_compute_and_drops_mtp_elsewhere(tmp_path, capsys):
    from safetensors.torch import load_file

    from megatron.models.gpt.hf import hf_architecture

    bad = dataclasses.replace(V3, moe_router_score_function="softmax", layernorm_epsilon=1e-5)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM would need") as err:
        hf_architecture(bad)
    assert "--moe-router-score-function sigmoid" in str(err.value)
    assert "--layernorm-epsilon 1e-6" in str(err.value)
    groups = dataclasses.replace(V3, moe_router_topk=2)  # HF scores a group by its top 2
    with pytest.raises(ValueError, match="2 x group-topk"):
        hf_architecture(groups)
    # a Llama-shaped GPT with an MTP depth: exported as Llama, the depth dropped with a note
    llama = ModelConfig(
        **{f: getattr(V3, f) for f in DENSE_FIELDS if "lora" not in f and "qk_" not in f}
        | {"multi_latent_attention": False, "v_head_dim": None, "rope_type": None}
        | {"rotary_scaling_factor": 1.0, "original_max_position_embeddings": 4096}
        | {"mscale_all_dim": 0.0}
    )
    model = GPTModel(llama, BuildContext(seed=2))
    assert to_hf(_unpadded(model, llama), _args(llama, 1, 1), str(tmp_path)) == "llama"
    assert "multi-token prediction depth(s) are not exported" in capsys.readouterr().err
    assert not any("eh_proj" in n for n in load_file(str(tmp_path / "model.safetensors")))


def test_import_says_why_it_refuses_a_config_and_what_an_epsilon_changes(capsys):
    from megatron.models.gpt.hf_deepseek import deepseek_config, deepseek_hf_config

    good = deepseek_hf_config(V3, {})  # 8 experts in 4 groups, top 4 of the best 2 groups
    groups = {**good, "num_experts_per_tok": 2}  # a group's top 2 against its top 2 / 2 = 1
    with pytest.raises(ValueError, match="transformers scores a group by the sum of its top 2"):
        deepseek_config(groups, 0)
    with pytest.raises(ValueError, match="biases on q_a_proj, kv_a_proj_with_mqa and o_proj"):
        deepseek_config({**good, "attention_bias": True}, 0)
    assert deepseek_config(good, 0)["layernorm_epsilon"] == 1e-6
    assert "rms_norm_eps" not in capsys.readouterr().err
    assert deepseek_config({**good, "rms_norm_eps": 1e-5}, 0)["layernorm_epsilon"] == 1e-5
    assert "latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6" in capsys.readouterr().err


def test_layers_config_json_does_not_count_are_refused_not_dropped(tmp_path):
    """A config.json that under-reports num_hidden_layers: its last real decoder layer is not
    taken for an MTP depth (the model imported truncated, exit 0); a depth it does not
    announce is refused too. Only the depths it announces are MTP."""
    import json

    model = GPTModel(V3, BuildContext(seed=3))  # 3 layers and 1 MTP depth: model.layers.3
    to_hf(_unpadded(model, V3), _args(V3, 1, 1), str(tmp_path))
    config = tmp_path / "config.json"
    honest = json.loads(config.read_text())
    counts = "num_hidden_layers ({}) and num_nextn_predict_layers ({})"
    for layers, depths, named in [(2, 1, "2, 3"), (3, 0, "3")]:
        config.write_text(
            json.dumps({**honest, "num_hidden_layers": layers, "num_nextn_predict_layers": depths})
        )
        want = f"the files hold layer(s) {named} that config.json's {counts.format(layers, depths)}"
        with pytest.raises(ValueError, match=re.escape(want)):
            from_hf(str(tmp_path))
    config.write_text(json.dumps(honest))
    assert from_hf(str(tmp_path))[1]["model"]["num_layers"] == 3
