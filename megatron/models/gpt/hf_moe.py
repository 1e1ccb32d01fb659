"""The MoE GPT to / from Hugging Face: MixtralForCausalLM and Qwen2MoeForCausalLM.

Both are Llama layers (RoPE, RMSNorm, GQA, SwiGLU, megatron.models.gpt.hf) whose MLP is a
router + E SwiGLU experts:
  Mixtral     every layer; softmax over the top-k logits (our default routing); no shared
              expert, no biases
  Qwen2-MoE   softmax over all E, top-k not renormalized (--moe-router-pre-softmax; with
              norm_topk_prob, our default); a shared expert gated by sigmoid(x w)
              (--moe-shared-expert-intermediate-size + --moe-shared-expert-gate); dense
              layers (--moe-layer-freq k) listed in mlp_only_layers
Experts are written in the Hub's per-expert layout (`...experts.<e>.w1.weight` / `gate_proj`),
which every transformers version reads; both it and transformers 5's fused layout
(`experts.gate_up_proj` (E, 2F, h), `experts.down_proj` (E, h, F)) are read back.
"""

from __future__ import annotations

import torch

from megatron.config.schema import ModelConfig

# Flags the MoE exports need, as (field, value, flag): on top of Llama's.
_NEEDS = (
    ("moe_expert_capacity_factor", None, "no --moe-expert-capacity-factor (HF never drops)"),
    ("moe_router_score_function", "softmax", "--moe-router-score-function softmax"),
    ("add_bias_linear", False, "--disable-bias-linear"),
    ("moe_router_enable_expert_bias", False, "no --moe-router-enable-expert-bias"),
    ("moe_router_group_topk", None, "no --moe-router-group-topk (no group-limited routing)"),
    ("moe_router_topk_scaling_factor", None, "no --moe-router-topk-scaling-factor"),
)


def moe_architecture(cfg: ModelConfig, llama_problems: list[str]) -> str:
    """'mixtral' or 'qwen2_moe' for an MoE GPT, or ValueError naming what is missing."""
    common = llama_problems + [flag for f, v, flag in _NEEDS if getattr(cfg, f) != v]
    mixtral = list(common)
    if cfg.moe_shared_expert_intermediate_size is not None:
        mixtral.append("no --moe-shared-expert-intermediate-size")
    if not all(cfg.moe_layer_pattern):  # Mixtral has no dense layers
        mixtral.append("--moe-layer-freq 1 (every layer MoE; Mixtral has no dense layers)")
    if cfg.moe_router_pre_softmax:
        mixtral.append("no --moe-router-pre-softmax")
    qwen = list(common)
    if cfg.moe_shared_expert_intermediate_size is None or not cfg.moe_shared_expert_gate:
        qwen.append("--moe-shared-expert-intermediate-size N --moe-shared-expert-gate")
    if not mixtral:
        return "mixtral"
    if not qwen:
        return "qwen2_moe"
    raise ValueError(
        "no Hugging Face MoE architecture matches this model: MixtralForCausalLM would need "
        f"{', '.join(mixtral)}; Qwen2MoeForCausalLM would need {', '.join(qwen)}"
    )


def _prefix(arch: str) -> tuple[str, str, str, str]:
    """(router, experts, gate name, up name, down name) under `model.layers.<i>.`."""
    if arch == "mixtral":
        return "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"
    return "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"


def moe_tensors(state: dict, cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """The HF tensors of the MoE layers (the rest is Llama's, megatron.models.gpt.hf)."""
    router, experts, gate, up, down = _prefix(arch)
    f, out = cfg.expert_ffn_size, {}
    for i in range(cfg.num_layers):
        p, o = f"layers.{cfg.layer_owner(i)}.mlp.", f"model.layers.{i}."
        if p + "router.weight" not in state:
            continue
        out[o + router + ".weight"] = state[p + "router.weight"]
        w1, w2 = state[p + "experts.weight1"], state[p + "experts.weight2"]  # (E, h, 2F), (E, F, h)
        for e in range(cfg.num_experts):
            out[f"{o}{experts}.{e}.{gate}.weight"] = w1[e, :, :f].t()
            out[f"{o}{experts}.{e}.{up}.weight"] = w1[e, :, f:].t()
            out[f"{o}{experts}.{e}.{down}.weight"] = w2[e].t()
        if arch == "qwen2_moe":
            s = cfg.moe_shared_expert_intermediate_size
            gate_up = state[p + "shared_expert.dense_h_to_4h.weight"]  # [gate; up]
            out[o + "mlp.shared_expert.gate_proj.weight"] = gate_up[:s]
            out[o + "mlp.shared_expert.up_proj.weight"] = gate_up[s:]
            out[o + "mlp.shared_expert.down_proj.weight"] = state[
                p + "shared_expert.dense_4h_to_h.weight"
            ]
            out[o + "mlp.shared_expert_gate.weight"] = state[p + "shared_expert_gate.weight"]
    return out


def moe_state(hf: dict, cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """Our MoE-layer tensors, popped from `hf` (per-expert or fused layout)."""
    router, experts, gate, up, down = _prefix(arch)
    state = {}
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p, o = f"layers.{i}.mlp.", f"model.layers.{i}."
        state[p + "router.weight"] = hf.pop(o + router + ".weight", None)
        if state[p + "router.weight"] is None:  # transformers 5 names Mixtral's `mlp.gate`
            state[p + "router.weight"] = hf.pop(o + "mlp.gate.weight")
        fused = [k for k in (o + experts, o + "mlp.experts") if k + ".gate_up_proj" in hf]
        if fused:  # transformers 5: (E, 2F, h) [gate; up], (E, h, F)
            state[p + "experts.weight1"] = hf.pop(fused[0] + ".gate_up_proj").transpose(1, 2)
            state[p + "experts.weight2"] = hf.pop(fused[0] + ".down_proj").transpose(1, 2)
        else:
            e_range = range(cfg.num_experts)
            pop = lambda e, n, o=o: hf.pop(f"{o}{experts}.{e}.{n}.weight")  # noqa: E731
            state[p + "experts.weight1"] = torch.stack(
                [torch.cat([pop(e, gate), pop(e, up)]).t() for e in e_range]
            )
            state[p + "experts.weight2"] = torch.stack([pop(e, down).t() for e in e_range])
        if arch == "qwen2_moe":
            sh = o + "mlp.shared_expert."
            gate_up = [hf.pop(sh + "gate_proj.weight"), hf.pop(sh + "up_proj.weight")]
            state[p + "shared_expert.dense_h_to_4h.weight"] = torch.cat(gate_up)
            state[p + "shared_expert.dense_4h_to_h.weight"] = hf.pop(sh + "down_proj.weight")
            state[p + "shared_expert_gate.weight"] = hf.pop(o + "mlp.shared_expert_gate.weight")
    return state


def moe_hf_config(cfg: ModelConfig, arch: str, llama: dict) -> dict:
    """config.json of the export, from the Llama one of the same model."""
    base = {k: v for k, v in llama.items() if k not in ("architectures", "model_type", "mlp_bias")}
    base.pop("pretraining_tp", None)
    base.pop("attention_bias", None)
    common = {**base, "num_experts_per_tok": cfg.moe_router_topk, "output_router_logits": False}
    common["router_aux_loss_coef"] = cfg.moe_aux_loss_coeff
    if arch == "mixtral":
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": cfg.expert_ffn_size,
            "num_local_experts": cfg.num_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return {
        **common,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "intermediate_size": cfg.ffn_size,  # the dense layers' MLP
        "moe_intermediate_size": cfg.expert_ffn_size,
        "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
        "qkv_bias": False,
        "use_sliding_window": False,
    }


def moe_config(hf: dict) -> dict:
    """Our MoE ModelConfig fields from a Mixtral / Qwen2-MoE config.json (Llama's are read by
    megatron.models.gpt.hf)."""
    kind = hf["model_type"]
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError("config.json router_jitter_noise: training-time noise not supported")
    fields = {"moe_router_topk": hf["num_experts_per_tok"]}
    fields["moe_aux_loss_coeff"] = float(hf.get("router_aux_loss_coef", 0.0))
    if kind == "mixtral":
        n = hf["num_local_experts"]
        return {**fields, "num_experts": n, "moe_ffn_hidden_size": hf["intermediate_size"]}
    if hf.get("qkv_bias", True):
        raise ValueError("config.json qkv_bias=true: biases on q/k/v only are not supported")
    dense = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    layers = hf["num_hidden_layers"]
    pattern = [int((i + 1) % step == 0 and i not in dense) for i in range(layers)]
    if not any(pattern):
        raise ValueError("config.json decoder_sparse_step / mlp_only_layers: no MoE layer")
    return {
        **fields,
        "num_experts": hf["num_experts"],
        "moe_layer_freq": layer_freq_of(pattern),
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": hf["shared_expert_intermediate_size"],
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
    }


def layer_freq_of(pattern: list[int]) -> str:
    """--moe-layer-freq for a 0/1 list of MoE layers: k where they are every k-th from layer
    0, else the list itself."""
    for k in range(1, len(pattern) + 1):
        if pattern == [int(i % k == 0) for i in range(len(pattern))]:
            return str(k)
    return "[" + ",".join(map(str, pattern)) + "]"
