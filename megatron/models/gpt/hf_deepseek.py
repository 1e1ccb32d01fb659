"""The DeepSeek-V3-shaped GPT to / from Hugging Face DeepseekV3ForCausalLM.

What maps (ours -> `model.layers.<i>.` of DeepseekV3):
  attention   multi-latent attention (model/attention/mla.py already uses HF's names: q_proj or
              q_a_proj + q_a_layernorm + q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
              kv_b_proj; `dense` is o_proj). Our RoPE is rotate-half, DeepSeek's checkpoints
              interleave the RoPE rows: the export interleaves the q_pe and k_pe rows and says
              rope_interleave true, the import de-interleaves them (or keeps them, when false);
              q . k is the same either way
  MLP         the first_k_dense_replace layers dense (--moe-layer-freq '([0]*k+[1]*(L-k))'),
              the others a sigmoid router (gate.weight) with e_score_correction_bias = our
              --moe-router-enable-expert-bias buffer, group-limited routing (n_group,
              topk_group), routed_scaling_factor (--moe-router-topk-scaling-factor), experts in
              the Hub's per-expert layout, shared_experts (n_shared_experts x the expert width)
  MTP         depth k's modules at model.layers.<L + k>. (DeepSeek's layout: enorm, hnorm,
              eh_proj, shared_head.norm, the layer, and copies of the embedding and head as
              embed_tokens / shared_head.head), with num_nextn_predict_layers = D. transformers'
              DeepseekV3ForCausalLM does not run them; it loads the main model and leaves them
An import keeps the MTP weights when config.json announces them and the files hold them.
"""

from __future__ import annotations

import sys

import torch

from megatron.config.schema import ModelConfig
from megatron.model.weights import OUTPUT_WEIGHTS, WORD_EMBEDDINGS

ARCH = "deepseek_v3"
_ATTENTION = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
)
_QUERIES = ("q_proj", "q_b_proj")  # rows per head: [nope, rope]


def first_dense_layers(cfg: ModelConfig) -> int | None:
    """k of first_k_dense_replace: the leading dense layers, all later ones MoE (None if the
    MoE layers are not such a suffix)."""
    pattern = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    k = pattern.index(True) if True in pattern else cfg.num_layers
    return k if all(pattern[k:]) else None


def deepseek_problems(cfg: ModelConfig) -> list[str]:
    """What DeepseekV3ForCausalLM needs of a multi-latent-attention GPT (flags to add)."""
    needs = [
        (cfg.normalization == "RMSNorm", "--normalization RMSNorm"),
        (cfg.swiglu, "--swiglu"),
        (not cfg.add_bias_linear, "--disable-bias-linear"),
        (cfg.position_embedding_type == "rope", "--position-embedding-type rope"),
        (first_dense_layers(cfg) is not None, "--moe-layer-freq '([0]*k+[1]*(L-k))'"),
        # HF builds the latent norms (q_a_layernorm, kv_a_layernorm) with eps 1e-6 always
        (cfg.layernorm_epsilon == 1e-6, "--layernorm-epsilon 1e-6"),
    ]
    if cfg.moe:
        shared = cfg.moe_shared_expert_intermediate_size or 0
        g = cfg.moe_router_group_topk
        needs += [
            (cfg.moe_router_score_function == "sigmoid", "--moe-router-score-function sigmoid"),
            (cfg.moe_expert_capacity_factor is None, "no --moe-expert-capacity-factor"),
            (not cfg.moe_shared_expert_gate, "no --moe-shared-expert-gate"),
            (shared % cfg.expert_ffn_size == 0, "a shared expert n x --moe-ffn-hidden-size"),
            # HF scores a group by its top 2 experts, Megatron-core by its top k / g
            (not g or cfg.moe_router_topk // g == 2, "--moe-router-topk = 2 x group-topk"),
            (cfg.num_experts >= 2, "--num-experts 2 or more (HF sums each group's top 2)"),
        ]
    return [flag for ok, flag in needs if not ok]


def _rope_rows(w: torch.Tensor, nope: int, rope: int, to_hf: bool) -> torch.Tensor:
    """Rows grouped as [nope, rope] per head: the rope rows between our rotate-half order
    (j, j + d/2 a pair) and DeepSeek's interleaved one (2j, 2j + 1 a pair)."""
    half = torch.arange(rope // 2)
    if to_hf:  # HF row 2j <- ours j, 2j + 1 <- ours j + d/2
        order = torch.stack([half, half + rope // 2], -1).reshape(-1)
    else:  # ours j <- HF 2j, ours j + d/2 <- HF 2j + 1
        order = torch.cat([2 * half, 2 * half + 1])
    heads = w.reshape(-1, nope + rope, *w.shape[1:])  # (heads, nope + rope, ...)
    rows = torch.cat([heads[:, :nope], heads[:, nope:][:, order]], 1)
    return rows.reshape(w.shape)


def _attention_weight(name: str, w: torch.Tensor, cfg: ModelConfig, to_hf: bool, interleave):
    if not interleave:
        return w
    if name in _QUERIES:
        return _rope_rows(w, cfg.qk_nope_dim, cfg.qk_rope_dim, to_hf)
    if name == "kv_a_proj_with_mqa":  # [latent (kv_lora_rank), k_pe]
        return _rope_rows(w, cfg.kv_rank, cfg.qk_rope_dim, to_hf)
    return w


def _layer_to_hf(state: dict, p: str, o: str, cfg: ModelConfig, out: dict) -> None:
    """One transformer layer's tensors (ours under `p`) as HF's (under `o`)."""
    out[o + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
    out[o + "post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
    a = p + "self_attention."
    for name in _ATTENTION:
        if a + name + ".weight" in state:
            w = _attention_weight(name, state[a + name + ".weight"], cfg, True, True)
            out[f"{o}self_attn.{name}.weight"] = w
    out[o + "self_attn.o_proj.weight"] = state[a + "dense.weight"]
    m = p + "mlp."
    if m + "router.weight" not in state:  # dense: [gate; up]
        f = cfg.ffn_size
        gate_up = state[m + "dense_h_to_4h.weight"]
        out[o + "mlp.gate_proj.weight"], out[o + "mlp.up_proj.weight"] = gate_up[:f], gate_up[f:]
        out[o + "mlp.down_proj.weight"] = state[m + "dense_4h_to_h.weight"]
        return
    out[o + "mlp.gate.weight"] = state[m + "router.weight"]
    bias = state.get(m + "router.expert_bias")
    if bias is None:  # no --moe-router-enable-expert-bias: DeepSeek's bias, zero
        bias = torch.zeros(cfg.num_experts)
    out[o + "mlp.gate.e_score_correction_bias"] = bias.float()
    f, (w1, w2) = cfg.expert_ffn_size, (state[m + "experts.weight1"], state[m + "experts.weight2"])
    for e in range(cfg.num_experts):  # ours (E, h, 2F) [gate | up], (E, F, h)
        out[f"{o}mlp.experts.{e}.gate_proj.weight"] = w1[e, :, :f].t()
        out[f"{o}mlp.experts.{e}.up_proj.weight"] = w1[e, :, f:].t()
        out[f"{o}mlp.experts.{e}.down_proj.weight"] = w2[e].t()
    s = cfg.moe_shared_expert_intermediate_size or 0
    gate_up = state.get(m + "shared_expert.dense_h_to_4h.weight")
    if gate_up is None:  # no shared expert: DeepSeek's of width 0
        gate_up, down = torch.zeros(0, cfg.hidden_size), torch.zeros(cfg.hidden_size, 0)
    else:
        down = state[m + "shared_expert.dense_4h_to_h.weight"]
    out[o + "mlp.shared_experts.gate_proj.weight"] = gate_up[:s]
    out[o + "mlp.shared_experts.up_proj.weight"] = gate_up[s:]
    out[o + "mlp.shared_experts.down_proj.weight"] = down


def deepseek_tensors(state: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every HF tensor of a full state (megatron.checkpoint.resharding), the MTP depths'
    included."""
    head = state[OUTPUT_WEIGHTS if cfg.untie_embeddings_and_output_weights else WORD_EMBEDDINGS]
    out = {"model.embed_tokens.weight": state[WORD_EMBEDDINGS]}
    for i in range(cfg.num_layers):
        _layer_to_hf(state, f"layers.{cfg.layer_owner(i)}.", f"model.layers.{i}.", cfg, out)
    for k in range(cfg.mtp_num_layers or 0):
        p, o = f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}."
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj")):
            out[f"{o}{theirs}.weight"] = state[f"{p}{ours}.weight"]
        out[o + "shared_head.norm.weight"] = state[p + "final_layernorm.weight"]
        _layer_to_hf(state, p + "transformer_layer.", o, cfg, out)
        out[o + "embed_tokens.weight"] = state[WORD_EMBEDDINGS]
        out[o + "shared_head.head.weight"] = head
    out["model.norm.weight"] = state["head.final_layernorm.weight"]
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = head
    return out


def _rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.mla_rope_type == "rope":
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rotary_base,
        "factor": cfg.rotary_scaling_factor,
        "original_max_position_embeddings": cfg.original_max_position_embeddings,
        "beta_fast": cfg.beta_fast,
        "beta_slow": cfg.beta_slow,
        "mscale": cfg.mscale,
        "mscale_all_dim": cfg.mscale_all_dim,
    }


def _moe_hf_config(cfg: ModelConfig) -> dict:
    """The routing and expert fields of config.json (a dense model: placeholders, as every
    layer is within first_k_dense_replace)."""
    if not cfg.moe:
        return {"n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}
    ffn, g = cfg.expert_ffn_size, cfg.moe_router_group_topk
    groups = cfg.moe_router_num_groups if g else 1
    return {
        "moe_intermediate_size": ffn,
        "n_shared_experts": (cfg.moe_shared_expert_intermediate_size or 0) // ffn,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
        "n_group": groups,
        "topk_group": g if g else 1,
        "norm_topk_prob": cfg.moe_router_topk > 1,  # ours normalises the chosen k > 1
    }


def deepseek_hf_config(cfg: ModelConfig, common: dict) -> dict:
    """config.json of the export; `common`: vocab, tying, tokens, dtype (megatron.models.gpt.hf)."""
    return {
        **common,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": ARCH,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "first_k_dense_replace": first_dense_layers(cfg),
        **_moe_hf_config(cfg),
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_rank,
        "qk_nope_head_dim": cfg.qk_nope_dim,
        "qk_rope_head_dim": cfg.qk_rope_dim,
        "v_head_dim": cfg.v_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_parameters": _rope_parameters(cfg),
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "num_nextn_predict_layers": cfg.mtp_num_layers or 0,
    }


def _check(hf: dict, name: str, ok, what: str) -> None:
    if not ok:
        raise ValueError(f"config.json {name}={hf.get(name)!r}: {what}")


def _rope_fields(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_type": "rope", "rotary_base": base}
    _check(hf, "rope_parameters", kind == "yarn", "only default RoPE and YaRN are supported")
    return {
        "rope_type": "yarn",
        "rotary_base": base,
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast", 32.0)),
        "beta_slow": float(rope.get("beta_slow", 1.0)),
        "mscale": float(rope.get("mscale", 1.0)),
        "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
    }


def deepseek_config(hf: dict, mtp_depth: int) -> dict:
    """Our ModelConfig fields from a DeepseekV3 config.json (`mtp_depth`: the MTP depths whose
    weights the files hold)."""
    _check(hf, "hidden_act", hf.get("hidden_act", "silu") == "silu", "ours is SwiGLU (silu)")
    _check(hf, "attention_bias", not hf.get("attention_bias", False), "DeepseekV3 then has "
           "biases on q_a_proj, kv_a_proj_with_mqa and o_proj, and our multi-latent attention "
           "has none: those self_attn.*.bias tensors have no place in the model")  # fmt: skip
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    _check(hf, "num_key_value_heads", kv_heads == heads, "MLA has one key/value per head")
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    eps = hf.get("rms_norm_eps", 1e-6)
    if eps != 1e-6:  # the export refuses it (deepseek_problems)
        print(
            f"note: config.json rms_norm_eps={eps}: transformers' latent norms (q_a_layernorm, "
            "kv_a_layernorm) use 1e-6 whatever it says, ours use it in every norm, so the "
            "imported model's logits differ slightly from transformers'",
            file=sys.stderr,
        )
    fields = {
        "num_layers": layers,
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "seq_length": hf["max_position_embeddings"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "layernorm_epsilon": eps,
        "swiglu": True,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "multi_latent_attention": True,
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_head_dim": hf["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "mtp_num_layers": mtp_depth or None,
        **_rope_fields(hf),
    }
    if dense >= layers:
        return fields
    return {**fields, **_moe_fields(hf, layers, dense)}


def _moe_fields(hf: dict, layers: int, dense: int) -> dict:
    k, groups = hf["num_experts_per_tok"], hf.get("n_group") or 1
    group_topk = hf.get("topk_group") or 1
    _check(hf, "norm_topk_prob", hf.get("norm_topk_prob", True) == (k > 1), "ours normalises "
           "the chosen sigmoid scores exactly when num_experts_per_tok > 1")  # fmt: skip
    limited = groups > 1 and group_topk < groups
    if limited:
        _check(hf, "topk_group", k // group_topk == 2, "transformers scores a group by the sum "
               "of its top 2 experts, ours (Megatron-core's) by its top num_experts_per_tok / "
               f"topk_group = {k // group_topk}; they choose the same groups only when "
               "num_experts_per_tok = 2 x topk_group")  # fmt: skip
    ffn, shared = hf["moe_intermediate_size"], hf.get("n_shared_experts") or 0
    scaling = float(hf.get("routed_scaling_factor", 1.0))
    return {
        "num_experts": hf["n_routed_experts"],
        "moe_ffn_hidden_size": ffn,
        "moe_shared_expert_intermediate_size": ffn * shared or None,
        "moe_router_topk": k,
        "moe_router_score_function": "sigmoid",
        "moe_layer_freq": f"([0]*{dense}+[1]*{layers - dense})",
        "moe_router_topk_scaling_factor": None if scaling == 1.0 else scaling,
        "moe_router_enable_expert_bias": True,  # e_score_correction_bias
        "moe_router_num_groups": groups if limited else None,
        "moe_router_group_topk": group_topk if limited else None,
    }


def _layer_from_hf(hf: dict, o: str, p: str, cfg: ModelConfig, moe: bool, interleave) -> dict:
    """One layer's tensors popped from `hf` (under `o`), ours under `p`."""
    state = {
        p + "input_layernorm.weight": hf.pop(o + "input_layernorm.weight"),
        p + "post_attention_layernorm.weight": hf.pop(o + "post_attention_layernorm.weight"),
        p + "self_attention.dense.weight": hf.pop(o + "self_attn.o_proj.weight"),
    }
    for name in _ATTENTION:
        w = hf.pop(f"{o}self_attn.{name}.weight", None)
        if w is not None:
            w = _attention_weight(name, w, cfg, False, interleave)
            state[f"{p}self_attention.{name}.weight"] = w
    m, h = p + "mlp.", o + "mlp."
    if not moe:
        gate_up = torch.cat([hf.pop(h + "gate_proj.weight"), hf.pop(h + "up_proj.weight")])
        state[m + "dense_h_to_4h.weight"] = gate_up
        state[m + "dense_4h_to_h.weight"] = hf.pop(h + "down_proj.weight")
        return state
    state[m + "router.weight"] = hf.pop(h + "gate.weight")
    state[m + "router.expert_bias"] = hf.pop(h + "gate.e_score_correction_bias").float()
    if h + "experts.gate_up_proj" in hf:  # transformers 5's fused layout: (E, 2F, h), (E, h, F)
        state[m + "experts.weight1"] = hf.pop(h + "experts.gate_up_proj").transpose(1, 2)
        state[m + "experts.weight2"] = hf.pop(h + "experts.down_proj").transpose(1, 2)
    else:
        pop = lambda e, n: hf.pop(f"{h}experts.{e}.{n}_proj.weight")  # noqa: E731
        experts = range(cfg.num_experts)
        state[m + "experts.weight1"] = torch.stack(
            [torch.cat([pop(e, "gate"), pop(e, "up")]).t() for e in experts]
        )
        state[m + "experts.weight2"] = torch.stack([pop(e, "down").t() for e in experts])
    s = h + "shared_experts."
    gate_up = torch.cat([hf.pop(s + "gate_proj.weight"), hf.pop(s + "up_proj.weight")])
    down = hf.pop(s + "down_proj.weight")
    if cfg.moe_shared_expert_intermediate_size:
        state[m + "shared_expert.dense_h_to_4h.weight"] = gate_up
        state[m + "shared_expert.dense_4h_to_h.weight"] = down
    return state


def deepseek_state(hf: dict, hf_cfg: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state, popped from `hf`: the decoder layers and the MTP depths imported; a layer
    past them stays in `hf` (one config.json does not account for: from_hf refuses it)."""
    interleave = hf_cfg.get("rope_interleave", True)
    state = {WORD_EMBEDDINGS: hf.pop("model.embed_tokens.weight")}
    state["head.final_layernorm.weight"] = hf.pop("model.norm.weight")
    if cfg.untie_embeddings_and_output_weights:
        state[OUTPUT_WEIGHTS] = hf.pop("lm_head.weight")
    for i in range(cfg.num_layers):
        o, p = f"model.layers.{i}.", f"layers.{i}."
        state.update(_layer_from_hf(hf, o, p, cfg, cfg.is_moe_layer(i), interleave))
    moe = cfg.is_moe_layer(cfg.num_layers - 1)
    for k in range(cfg.mtp_num_layers or 0):
        o, p = f"model.layers.{cfg.num_layers + k}.", f"mtp.layers.{k}."
        for name in ("enorm", "hnorm", "eh_proj"):
            state[f"{p}{name}.weight"] = hf.pop(f"{o}{name}.weight")
        state[p + "final_layernorm.weight"] = hf.pop(o + "shared_head.norm.weight")
        state.update(_layer_from_hf(hf, o, p + "transformer_layer.", cfg, moe, interleave))
        for copy in ("embed_tokens.weight", "shared_head.head.weight"):  # the shared ones
            hf.pop(o + copy, None)
    return state


def mtp_depth_held(hf: dict, hf_cfg: dict) -> int:
    """The MTP depths config.json announces whose weights (eh_proj) the files hold."""
    layers, depth = hf_cfg["num_hidden_layers"], hf_cfg.get("num_nextn_predict_layers", 0) or 0
    held = 0
    while held < depth and f"model.layers.{layers + held}.eh_proj.weight" in hf:
        held += 1
    if held < depth:
        print(
            f"note: config.json announces {depth} multi-token prediction depth(s), the files "
            f"hold {held}: the model is imported with {held} (--mtp-num-layers)",
            file=sys.stderr,
        )
    return held
