"""The model and tokenizer arguments every checkpoint records (`checkpoint_args`: tools load a
checkpoint without repeating them) and their check on resume (`check_model_args`): the
parameter shapes must match, and so must an MoE model's router, unless --finetune."""

from __future__ import annotations

import dataclasses
import os

from megatron.checkpoint.storage import CheckpointError
from megatron.config.declare import ConfigError
from megatron.config.layer_pattern import expand_layer_freq, window_layer_pattern
from megatron.config.schema import MegatronConfig
from megatron.config.schema_model_mla import YARN_DEFAULTS
from megatron.config.schema_model_window import parse_window

# Fields of ModelConfig that change parameter shapes: a resume must match them.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "mtp_num_layers",
)
# Multi-latent attention's shape fields, with the value a checkpoint that predates them had.
MLA_FIELDS = {
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": None,
    "qk_head_dim": None,
    "qk_pos_emb_head_dim": None,
    "v_head_dim": None,
}

# Multi-latent attention's RoPE (--rope-type, YaRN's settings), with the value a checkpoint
# that predates them had: the frequencies and attention factor its weights were trained with.
ROPE_FIELDS = {"rope_type": None, **YARN_DEFAULTS}  # rope_type None: yarn under MLA


# MoE router settings a checkpoint records that change what its experts see: a resume keeps
# them; --finetune (a new run from the weights) may change them, as Megatron-LM's check of the
# checkpoint's arguments is skipped with --finetune too.
ROUTER_FIELDS = (
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
)  # not --moe-router-enable-expert-bias: turned on, the bias starts at zero (expert_bias_note)

_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")


def checkpoint_args(cfg: MegatronConfig) -> dict:
    p = cfg.parallel
    return {
        "model": dataclasses.asdict(cfg.model),
        # Absolute paths: tools load the tokenizer from wherever they are started.
        "tokenizer": {
            k: os.path.abspath(v) if k in _TOKENIZER_FILES and v else v
            for k, v in dataclasses.asdict(cfg.data.tokenizer).items()
        },
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "padded_vocab_size": cfg.model.padded_vocab_size(p.tensor_model_parallel_size),
        "params_dtype": str(cfg.precision.params_dtype),
    }


def check_model_args(saved: dict, cfg: MegatronConfig, path: str) -> None:
    """The checkpoint's recorded model arguments against this run's: shapes must match; so must
    an MoE model's router settings, unless --finetune starts a new run from the weights."""
    saved_model = saved.get("args", {}).get("model", {})
    current = dataclasses.asdict(cfg.model)
    for name in SHAPE_FIELDS:
        if name in saved_model and saved_model[name] != current[name]:
            raise CheckpointError(
                f"{path}: the checkpoint was saved with {name}={saved_model[name]!r} but this run "
                f"has {current[name]!r}; pass the same model flags (or convert the checkpoint)"
            )
    _check_attention(saved_model, current, path)
    _check_rope(saved_model, current, path, cfg.checkpoint.finetune)
    _check_window(saved_model, current, path, cfg.checkpoint.finetune)
    if cfg.checkpoint.finetune or not cfg.model.moe or saved_model.get("num_experts") is None:
        return
    for name in ROUTER_FIELDS:
        layers = current["num_layers"]  # the checkpoint's too: a shape field
        if name in saved_model and _router_value(name, saved_model, layers) != _router_value(
            name, current, layers
        ):
            flag = "--" + name.replace("_", "-")
            was, now = _as_flag(flag, saved_model[name]), _as_flag(flag, current[name])
            raise CheckpointError(
                f"{path}: the checkpoint's MoE router was trained with {was}, but this run has "
                f"{now}; resuming would route tokens otherwise than the experts were trained "
                f"with. Fix: resume with {was}, or pass --finetune to "
                "start a new run from these weights (iteration 0, fresh optimizer) with the "
                "new router"
            )


def expert_bias_note(saved: dict, cfg: MegatronConfig) -> str | None:
    """The line a load logs when --moe-router-enable-expert-bias differs from the checkpoint's
    (megatron.checkpoint.expert_bias: the biases start at zero, or are dropped); None if not."""
    saved_model = saved.get("args", {}).get("model", {})
    if not cfg.model.moe or saved_model.get("num_experts") is None:
        return None
    was = bool(saved_model.get("moe_router_enable_expert_bias", False))
    if was == cfg.model.moe_router_enable_expert_bias:
        return None
    if was:
        return (
            "the checkpoint's MoE router expert biases are dropped: this run has no "
            "--moe-router-enable-expert-bias (add it to keep them)"
        )
    return (
        "--moe-router-enable-expert-bias: the checkpoint has no expert bias; each MoE "
        "router's bias starts at zero and is updated from here"
    )


def _router_value(name: str, model: dict, num_layers: int):
    """A router field of recorded model arguments as a resume compares it: --moe-layer-freq as
    the layers it makes MoE (`[1]*4` is `1` for 4 layers; older checkpoints recorded the int 2),
    or as spelled where it does not parse."""
    value = model[name]
    if name != "moe_layer_freq":
        return value
    try:
        return expand_layer_freq(value, num_layers)
    except ConfigError:
        return "".join(value.split()) if isinstance(value, str) else value


def _as_flag(flag: str, value) -> str:
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def _check_attention(saved_model: dict, current: dict, path: str) -> None:
    """Multi-latent attention against the checkpoint's (absent from older ones: no MLA)."""
    for name, absent in MLA_FIELDS.items():
        was = saved_model.get(name, absent)
        if was == current[name]:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "multi_latent_attention":
            kind = "with" if was else "without"
            raise CheckpointError(
                f"{path}: the checkpoint was saved {kind} --multi-latent-attention and this run "
                f"is {'without' if was else 'with'} it: its attention weights do not exist in "
                f"this model. Fix: {'add' if was else 'drop'} --multi-latent-attention (and "
                "its sizes) to resume it, or train the new attention from scratch"
            )
        raise CheckpointError(
            f"{path}: the checkpoint was saved with {_as_flag(flag, was)} but this run has "
            f"{_as_flag(flag, current[name])}; pass the same multi-latent attention sizes"
        )


def _check_rope(saved_model: dict, current: dict, path: str, finetune: bool) -> None:
    """An MLA checkpoint resumed under other RoPE settings than it was trained with: refused
    (the rotary frequencies and YaRN's attention factor change under the trained weights),
    unless --finetune starts a new run from the weights (a context extension)."""
    if finetune or not current["multi_latent_attention"]:
        return
    saved = {name: saved_model.get(name, absent) for name, absent in ROPE_FIELDS.items()}
    now = {name: current[name] for name in ROPE_FIELDS}
    for model in (saved, now):
        model["rope_type"] = model["rope_type"] or "yarn"  # MLA's default
        if model["rope_type"] == "rope":  # YaRN's settings do nothing then
            model.update({n: ROPE_FIELDS[n] for n in ROPE_FIELDS if n != "rope_type"})
    differ = [n for n in ROPE_FIELDS if saved[n] != now[n]]
    if not differ:
        return

    def flags(model: dict) -> str:  # YaRN's settings where it is YaRN
        names = [n for n in differ if n == "rope_type" or model["rope_type"] == "yarn"]
        return " ".join(f"--{n.replace('_', '-')} {model[n]}" for n in names)

    raise CheckpointError(
        f"{path}: the checkpoint's multi-latent attention was trained with {flags(saved)}, but "
        f"this run has {flags(now)}; resuming would change its RoPE frequencies under the "
        f"trained weights. Fix: resume with {flags(saved)}, or pass --finetune to start a new "
        "run from these weights with the new RoPE (as a context extension does)"
    )


def _attention_span(model: dict) -> tuple:
    """(each layer's window LEFT or None, --softmax-type) of recorded model arguments (older
    checkpoints record neither: global layers, the vanilla softmax)."""
    size, skip = model.get("window_size"), model.get("window_attn_skip_freq")
    left = None if size is None else parse_window(size)[0]
    layers = window_layer_pattern(size is not None, skip, model["num_layers"])
    return tuple(left if w else None for w in layers), model.get("softmax_type", "vanilla")


def _as_window_flags(model: dict) -> str:
    flags = [f"--softmax-type {model.get('softmax_type', 'vanilla')}"]
    if model.get("window_size") is not None:
        flags.insert(0, f"--window-size {model['window_size']}")
        if model.get("window_attn_skip_freq") is not None:
            flags.insert(1, f"--window-attn-skip-freq {model['window_attn_skip_freq']}")
    return " ".join(flags) if len(flags) > 1 else f"no --window-size, {flags[0]}"


def _check_window(saved_model: dict, current: dict, path: str, finetune: bool) -> None:
    """A checkpoint resumed with other windows or another softmax than it was trained with:
    refused (the layers would see other keys than they learned with), unless --finetune."""
    if finetune or _attention_span(saved_model) == _attention_span(current):
        return
    was, now = _as_window_flags(saved_model), _as_window_flags(current)
    raise CheckpointError(
        f"{path}: the checkpoint was trained with {was}, but this run has {now}; resuming "
        f"would change which keys its layers attend to. Fix: resume with {was}, or pass "
        "--finetune to start a new run from these weights with the new attention"
    )
