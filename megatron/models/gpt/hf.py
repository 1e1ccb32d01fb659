"""Export a full state (megatron.checkpoint.resharding) as a Hugging Face model, and back.

Two architectures match our GPT exactly (same logits in fp32):
  GPT2LMHeadModel   learned positions, LayerNorm, exact GeLU ("gelu") or with --openai-gelu
                    GPT-2's own tanh GeLU ("gelu_new"), biases, one KV head per head
  LlamaForCausalLM  RoPE (rotate-half, as ours), RMSNorm, SwiGLU; any GQA, biases optional
  (with --window-size on every layer: MistralForCausalLM, megatron.models.gpt.hf_mistral)
With --num-experts, MixtralForCausalLM or Qwen2MoeForCausalLM (megatron.models.gpt.hf_moe);
with --multi-latent-attention, DeepseekV3ForCausalLM (megatron.models.gpt.hf_deepseek), whose
config.json also carries the multi-token prediction depths (the other architectures drop them).
Shared layers (--num-unique-layers) are written out once per layer; --apply-query-key-layer-
scaling changes no logits. --apply-residual-connection-post-layernorm has no HF twin, and
other flag combinations raise ValueError. Files written: config.json, model.safetensors,
generation_config.json and, when the tokenizer files are known, the tokenizer. Reading needs
only `safetensors` (no `transformers`, no network).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megatron.checkpoint.hf_files import save_safetensors
from megatron.checkpoint.resharding import (
    POSITION_EMBEDDINGS,
    check_full_state,
    full_shapes,
    model_config,
    whole_model_args,
)
from megatron.config.schema import ModelConfig
from megatron.model.weights import OUTPUT_WEIGHTS, WORD_EMBEDDINGS
from megatron.models.gpt import hf_mistral as mistral
from megatron.models.gpt.hf_deepseek import (
    ARCH as DEEPSEEK,
)
from megatron.models.gpt.hf_deepseek import (
    deepseek_config,
    deepseek_hf_config,
    deepseek_problems,
    deepseek_state,
    deepseek_tensors,
    mtp_depth_held,
)
from megatron.models.gpt.hf_moe import (
    moe_architecture,
    moe_config,
    moe_hf_config,
    moe_state,
    moe_tensors,
)
from megatron.models.gpt.hf_read import HFTensors, not_accounted_for, read_safetensors
from megatron.models.gpt.hf_tokenizer import export_tokenizer, import_tokenizer, write_json

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe")
MISTRAL = mistral.ARCH


_GPT2_NEEDS = {
    "position_embedding_type": ("learned", "--position-embedding-type learned"),
    "normalization": ("LayerNorm", "--normalization LayerNorm"),
    "swiglu": (False, "no --swiglu"),
    "add_bias_linear": (True, "no --disable-bias-linear"),
}
_LLAMA_NEEDS = {
    "position_embedding_type": ("rope", "--position-embedding-type rope"),
    "normalization": ("RMSNorm", "--normalization RMSNorm"),
    "swiglu": (True, "--swiglu"),
}


def hf_architecture(cfg: ModelConfig) -> str:
    """'gpt2', 'llama', 'mixtral' or 'qwen2_moe': the HF architecture computing exactly what
    our model computes."""
    if cfg.apply_residual_connection_post_layernorm:
        raise ValueError(
            "--apply-residual-connection-post-layernorm: no Hugging Face GPT architecture "
            "takes its residuals after the layer norm (GPT-2 and Llama are pre-norm), so no "
            "export would compute this model's logits"
        )
    mistral.refuse_sinks(cfg)
    if cfg.window is not None:  # no architecture may drop the window
        return mistral.window_architecture(
            cfg, [f for k, (v, f) in _LLAMA_NEEDS.items() if getattr(cfg, k) != v]
        )
    if cfg.multi_latent_attention:
        problems = deepseek_problems(cfg)
        if problems:
            raise ValueError(
                "no Hugging Face architecture matches this multi-latent-attention model: "
                f"DeepseekV3ForCausalLM would need {', '.join(problems)}"
            )
        return DEEPSEEK
    if cfg.moe:
        llama = [flag for f, (v, flag) in _LLAMA_NEEDS.items() if getattr(cfg, f) != v]
        return moe_architecture(cfg, llama)
    gpt2 = [flag for f, (v, flag) in _GPT2_NEEDS.items() if getattr(cfg, f) != v]
    if cfg.query_groups != cfg.num_attention_heads:
        gpt2.append("no --num-query-groups (GPT-2 has one key/value head per query head)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        gpt2.append("no --kv-channels (GPT-2's head size is hidden / heads)")
    llama = [flag for f, (v, flag) in _LLAMA_NEEDS.items() if getattr(cfg, f) != v]
    if not gpt2:
        return "gpt2"
    if not llama:
        return "llama"
    hint = ""
    if cfg.position_embedding_type == "rope" and not cfg.swiglu:
        hint = " (RoPE with a GeLU MLP is GPT-NeoX-like: GPTNeoXForCausalLM, not implemented)"
    elif cfg.position_embedding_type == "learned" and cfg.swiglu:
        hint = " (learned positions with SwiGLU match no standard HF architecture)"
    raise ValueError(
        "no Hugging Face architecture matches this model"
        f"{hint}: GPT2LMHeadModel would need {', '.join(gpt2)}; "
        f"LlamaForCausalLM would need {', '.join(llama)}"
    )


def split_qkv(t: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Our fused rows [q_1..q_{n/g}, k, v] per group -> (q (n d, ...), k (g d, ...), v)."""
    g, d, n = cfg.query_groups, cfg.head_dim, cfg.num_attention_heads
    rest = t.shape[1:]
    t = t.reshape(g, n // g + 2, d, *rest)  # (groups, heads per group + k + v, d, ...)
    q = t[:, : n // g].reshape(n * d, *rest)
    return q, t[:, -2].reshape(g * d, *rest), t[:, -1].reshape(g * d, *rest)


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig):
    """Inverse of split_qkv."""
    g, d, n = cfg.query_groups, cfg.head_dim, cfg.num_attention_heads
    rest = q.shape[1:]
    parts = (q.reshape(g, n // g, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape((n + 2 * g) * d, *rest)


# Per layer: (our name, HF name); the HF names are relative to the layer prefix.
_GPT2_LAYER = (
    ("input_layernorm.weight", "ln_1.weight"),
    ("input_layernorm.bias", "ln_1.bias"),
    ("self_attention.dense.bias", "attn.c_proj.bias"),
    ("post_attention_layernorm.weight", "ln_2.weight"),
    ("post_attention_layernorm.bias", "ln_2.bias"),
    ("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias"),
    ("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias"),
)
# GPT-2's Conv1D stores weights as (in, out): the transpose of our (out, in).
_GPT2_CONV1D = (
    ("self_attention.dense.weight", "attn.c_proj.weight"),
    ("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight"),
    ("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight"),
)
_LLAMA_LAYER = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.dense.weight", "self_attn.o_proj.weight"),
    ("self_attention.dense.bias", "self_attn.o_proj.bias"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.dense_4h_to_h.weight", "mlp.down_proj.weight"),
    ("mlp.dense_4h_to_h.bias", "mlp.down_proj.bias"),
)


def _gpt2_tensors(state: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": state[WORD_EMBEDDINGS]}
    out["transformer.wpe.weight"] = state[POSITION_EMBEDDINGS]
    for i in range(cfg.num_layers):
        p, o = f"layers.{cfg.layer_owner(i)}.", f"transformer.h.{i}."  # shared: copied
        for ours, theirs in _GPT2_LAYER:
            out[o + theirs] = state[p + ours]
        for ours, theirs in _GPT2_CONV1D:
            out[o + theirs] = state[p + ours].t()
        qkv = p + "self_attention.query_key_value."
        # HF's c_attn is [all q | all k | all v] along its output, not per-head interleaved.
        out[o + "attn.c_attn.weight"] = torch.cat(split_qkv(state[qkv + "weight"], cfg)).t()
        out[o + "attn.c_attn.bias"] = torch.cat(split_qkv(state[qkv + "bias"], cfg))
    out["transformer.ln_f.weight"] = state["head.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = state["head.final_layernorm.bias"]
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state[OUTPUT_WEIGHTS]
    return out


def _gpt2_state(hf: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {WORD_EMBEDDINGS: hf.pop("wte.weight"), POSITION_EMBEDDINGS: hf.pop("wpe.weight")}
    for i in range(cfg.num_layers):
        p, o = f"layers.{i}.", f"h.{i}."
        c_attn = hf.pop(o + "attn.c_attn.weight").t()  # (3 h, h): [q; k; v]
        state[p + "self_attention.query_key_value.weight"] = join_qkv(*c_attn.chunk(3), cfg)
        bias = hf.pop(o + "attn.c_attn.bias").chunk(3)
        state[p + "self_attention.query_key_value.bias"] = join_qkv(*bias, cfg)
        for ours, theirs in _GPT2_LAYER + _GPT2_CONV1D:
            t = hf.pop(o + theirs)
            state[p + ours] = t.t() if (ours, theirs) in _GPT2_CONV1D else t
    state["head.final_layernorm.weight"] = hf.pop("ln_f.weight")
    state["head.final_layernorm.bias"] = hf.pop("ln_f.bias")
    if cfg.untie_embeddings_and_output_weights:
        state[OUTPUT_WEIGHTS] = hf.pop("lm_head.weight")
    return state


def _llama_tensors(state: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": state[WORD_EMBEDDINGS]}
    ffn = cfg.ffn_size
    params = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    for i in range(cfg.num_layers):
        p, o = f"layers.{cfg.layer_owner(i)}.", f"model.layers.{i}."  # shared: copied
        for ours, theirs in _LLAMA_LAYER:
            if p + ours in state:
                out[o + theirs] = state[p + ours]
        for param in params:
            q, k, v = split_qkv(state[f"{p}self_attention.query_key_value.{param}"], cfg)
            out[f"{o}self_attn.q_proj.{param}"] = q
            out[f"{o}self_attn.k_proj.{param}"] = k
            out[f"{o}self_attn.v_proj.{param}"] = v
            if f"{p}mlp.dense_h_to_4h.{param}" not in state:  # an MoE layer (hf_moe.py)
                continue
            gate_up = state[f"{p}mlp.dense_h_to_4h.{param}"]  # [gate; up]
            out[f"{o}mlp.gate_proj.{param}"] = gate_up[:ffn]
            out[f"{o}mlp.up_proj.{param}"] = gate_up[ffn:]
    out["model.norm.weight"] = state["head.final_layernorm.weight"]
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state[OUTPUT_WEIGHTS]
    return out


def _llama_state(hf: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {WORD_EMBEDDINGS: hf.pop("model.embed_tokens.weight")}
    params = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    for i in range(cfg.num_layers):
        p, o = f"layers.{i}.", f"model.layers.{i}."
        for param in params:
            q, k, v = (hf.pop(f"{o}self_attn.{x}_proj.{param}") for x in "qkv")
            state[f"{p}self_attention.query_key_value.{param}"] = join_qkv(q, k, v, cfg)
            if cfg.is_moe_layer(i):  # its experts: hf_moe.py
                continue
            gate, up = (hf.pop(f"{o}mlp.{x}_proj.{param}") for x in ("gate", "up"))
            state[f"{p}mlp.dense_h_to_4h.{param}"] = torch.cat([gate, up])
        for ours, theirs in _LLAMA_LAYER:
            if ours.startswith("mlp.") and cfg.is_moe_layer(i):
                continue
            if ours.endswith("weight") or cfg.add_bias_linear:
                state[p + ours] = hf.pop(o + theirs)
    state["head.final_layernorm.weight"] = hf.pop("model.norm.weight")
    if cfg.untie_embeddings_and_output_weights:
        state[OUTPUT_WEIGHTS] = hf.pop("lm_head.weight")
    return state


def _hf_config(cfg: ModelConfig, arch: str, dtype: torch.dtype, eod: int | None) -> dict:
    common = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_method_std,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": cfg.max_positions,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_size,
            # exact (erf) GeLU, or --openai-gelu: GPT-2's own tanh form, HF's gelu_new
            "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
            "layer_norm_epsilon": cfg.layernorm_epsilon,
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            **common,
        }
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.layernorm_epsilon,
        # Older transformers read rope_theta, newer ones rope_parameters.
        "rope_theta": cfg.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "attention_bias": cfg.add_bias_linear,
        "mlp_bias": cfg.add_bias_linear,
        "attention_dropout": cfg.attention_dropout,
        "pretraining_tp": 1,
        **common,
    }
    if arch == DEEPSEEK:
        return deepseek_hf_config(cfg, common)
    if arch == MISTRAL:
        return mistral.mistral_hf_config(cfg, llama)
    return moe_hf_config(cfg, arch, llama) if arch in MOE_ARCHITECTURES else llama


def _export_tensors(state: dict, cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    if arch == "gpt2":
        return _gpt2_tensors(state, cfg)
    if arch == DEEPSEEK:
        return deepseek_tensors(state, cfg)
    tensors = _llama_tensors(state, cfg)
    if arch in MOE_ARCHITECTURES:
        tensors.update(moe_tensors(state, cfg, arch))
    return tensors


def _implied_shapes(cfg: ModelConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the export of `cfg` writes: what config.json implies
    (the state on the meta device: no memory)."""
    meta = {n: torch.empty(s, device="meta") for n, s in full_shapes(cfg).items()}
    tensors = _export_tensors(meta, cfg, arch)
    return {n.removeprefix("transformer."): tuple(t.shape) for n, t in tensors.items()}


def to_hf(
    full_state: dict[str, torch.Tensor],
    args: dict,
    out_dir: str,
    tokenizer_files: list[str] | None = None,
) -> str:
    """Write `out_dir` for `transformers` `from_pretrained`; returns the architecture
    (hf_architecture).

    `tokenizer_files` (vocab.json + merges.txt, a tokenizer.json, or a SentencePiece .model)
    default to the files recorded in the checkpoint's args, where they still exist.
    """
    cfg = model_config(args)
    arch = hf_architecture(cfg)
    check_full_state(full_state, cfg, "the state to export")
    tensors = _export_tensors(full_state, cfg, arch)
    if cfg.mtp_num_layers and arch != DEEPSEEK:
        print(
            f"note: the {cfg.mtp_num_layers} multi-token prediction depth(s) are not exported: "
            f"the {arch} architecture has no place for them (DeepseekV3's has)",
            file=sys.stderr,
        )
    os.makedirs(out_dir, exist_ok=True)
    eod = export_tokenizer(args.get("tokenizer") or {}, out_dir, tokenizer_files, cfg)
    dtype = full_state[WORD_EMBEDDINGS].dtype
    # safetensors wants contiguous tensors that share no memory.
    tensors = {n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()}
    save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    write_json(os.path.join(out_dir, "config.json"), _hf_config(cfg, arch, dtype, eod))
    if eod is not None:
        generation = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}
        write_json(os.path.join(out_dir, "generation_config.json"), generation)
    return arch


def _check_equal(hf: dict, name: str, want, what: str) -> None:
    if hf.get(name, want) != want:
        raise ValueError(f"config.json {name}={hf[name]!r}: {what}")


def _gpt2_config(hf: dict) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"config.json activation_function={act!r}: ours is GeLU")
    _check_equal(hf, "scale_attn_by_inverse_layer_idx", False, "not supported")
    _check_equal(hf, "scale_attn_weights", True, "ours always scales by 1/sqrt(head_dim)")
    _check_equal(hf, "add_cross_attention", False, "not supported")
    return {
        "num_layers": hf["n_layer"],
        "hidden_size": hf["n_embd"],
        "num_attention_heads": hf["n_head"],
        "ffn_hidden_size": hf.get("n_inner") or 4 * hf["n_embd"],
        "seq_length": hf["n_positions"],
        "max_position_embeddings": hf["n_positions"],
        "layernorm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "hidden_dropout": hf.get("resid_pdrop", 0.1),
        "attention_dropout": hf.get("attn_pdrop", 0.1),
        "openai_gelu": act != "gelu",  # gelu_new / gelu_pytorch_tanh: the tanh form
    }


def _llama_config(hf: dict) -> dict:
    _check_equal(hf, "hidden_act", "silu", "ours is SwiGLU (silu)")
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ValueError("config.json: RoPE scaling (rope_scaling / rope_type) is not supported")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ValueError(
            "config.json: attention_bias and mlp_bias must agree (--disable-bias-linear)"
        )
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": None if groups == heads else groups,
        "kv_channels": None if head_dim * heads == hf["hidden_size"] else head_dim,
        "ffn_hidden_size": hf["intermediate_size"],
        "seq_length": hf["max_position_embeddings"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "position_embedding_type": "rope",
        "rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "add_bias_linear": bool(hf.get("attention_bias", False)),
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
    }


def _import_config(hf_dir: str, hf_cfg: dict, hf: dict, tied: bool) -> ModelConfig:
    """Our ModelConfig of a config.json (`hf`: the files' tensors, for the MTP depths held)."""
    kind = hf_cfg["model_type"]
    try:
        if kind == DEEPSEEK:
            fields = deepseek_config(hf_cfg, mtp_depth_held(hf, hf_cfg))
        elif kind == "gpt2":
            fields = _gpt2_config(hf_cfg)
        else:
            fields = _llama_config(hf_cfg)
            if kind == MISTRAL:  # Llama's, with a window
                fields.update(mistral.mistral_fields(hf_cfg, fields["seq_length"]))
        if kind in MOE_ARCHITECTURES:
            fields.update(moe_config(hf_cfg))
        vocab = hf_cfg["vocab_size"]
    except KeyError as e:
        raise ValueError(
            f"--from-hf {hf_dir}: config.json has no {e.args[0]!r}, which a {kind} model needs"
        ) from None
    return ModelConfig(
        vocab_size=vocab,
        init_method_std=hf_cfg.get("initializer_range", 0.02),
        untie_embeddings_and_output_weights=not tied,
        **fields,
    )


def from_hf(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(full state, checkpoint args at TP = PP = 1) of a GPT-2, Llama, Mixtral or Qwen2-MoE
    directory, offline."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--from-hf {hf_dir}: no config.json there (not a Hugging Face model)")
    with open(config_path, encoding="utf-8") as f:
        hf_cfg = json.load(f)
    kind = hf_cfg.get("model_type")
    if kind not in ("gpt2", "llama", MISTRAL, DEEPSEEK, *MOE_ARCHITECTURES):
        raise ValueError(
            f"--from-hf {hf_dir}: model_type {kind!r} is not supported (gpt2, llama, "
            "mistral, mixtral, qwen2_moe, deepseek_v3; BERT: bert, megatron-bert)"
        )
    hf = read_safetensors(hf_dir)
    # transformers' default is tied when the key is absent (DeepseekV3's: untied)
    tied = hf_cfg.get("tie_word_embeddings", kind != DEEPSEEK)
    cfg = _import_config(hf_dir, hf_cfg, hf, tied)
    if kind == "gpt2":
        # Hub files name GPT-2's tensors without the `transformer.` prefix; both are read.
        hf = {n.removeprefix("transformer."): t for n, t in hf.items()}
    shapes = _implied_shapes(cfg, kind)
    hf = HFTensors(hf, shapes, f"--from-hf {hf_dir}", cfg.num_layers)
    if kind == "gpt2":
        ignored = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old versions
        state = _gpt2_state(hf, cfg)
    elif kind == DEEPSEEK:
        ignored = ("rotary_emb.inv_freq",)
        state = deepseek_state(hf, hf_cfg, cfg)
    else:
        ignored = ("rotary_emb.inv_freq",)
        moe = moe_state(hf, cfg, kind) if kind in MOE_ARCHITECTURES else {}
        state = {**_llama_state(hf, cfg), **moe}
    if tied:
        hf.pop("lm_head.weight", None)  # a tied head may be saved too; it is the embedding
    left = [n for n in hf if not n.endswith(ignored)]
    if left:
        raise ValueError(f"--from-hf {hf_dir}: {not_accounted_for(left, hf_cfg)}")
    state = {n: t.contiguous() for n, t in state.items()}
    check_full_state(state, cfg, f"--from-hf {hf_dir}")
    args = whole_model_args(cfg, import_tokenizer(hf_dir), state[WORD_EMBEDDINGS].dtype)
    return state, args
