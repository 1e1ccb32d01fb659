"""BertModel <-> Hugging Face, on full (TP = 1, merged) state dicts.

The layer order picks the twin, which computes exactly what our model computes:
  pre-LN (the default, Megatron's BERT)    MegatronBertForPreTraining  (model_type megatron-bert)
  post-LN (--apply-residual-connection-post-layernorm, the original BERT)
                                           BertForPreTraining          (model_type bert)
A BERT trained with --bert-no-binary-head has no pooler and no NSP head: it is written as the
twin's *ForMaskedLM, whose names are the same less bert.pooler and cls.seq_relationship.

Norms. Pre-LN: MegatronBert has no embedding norm; layer l's attention.ln is our
layers.l.input_layernorm, its ln (before the MLP) our post_attention_layernorm, and encoder.ln our
head.final_layernorm. Post-LN: ours are BERT's renamed (models/bert/model.py):
embeddings.LayerNorm = layers.0.input_layernorm; layer l's attention.output.LayerNorm =
layers.l.post_attention_layernorm; layer l's output.LayerNorm = layers.(l+1).input_layernorm, or
head.final_layernorm for the last layer.

query_key_value rows are per head [q_i, k_i, v_i] (one query per key/value group), so
W_qkv.view(n, 3, d, h)[:, j] stacks the heads of q (j = 0), k (1) or v (2). The MLM decoder is
tied to the word embedding and its bias to cls.predictions.bias (our head.lm_bias); HF's vocab is
the real one, so the padding rows of ours are dropped on export and zero on import.
"""

from __future__ import annotations

import torch

from megatron.checkpoint.hf_files import save_safetensors
from megatron.checkpoint.resharding import whole_model_args
from megatron.config.schema import ModelConfig, model_config_from_saved

_TWINS = {  # post-LN? -> (model_type, with the NSP head, without it)
    True: ("bert", "BertForPreTraining", "BertForMaskedLM"),
    False: ("megatron-bert", "MegatronBertForPreTraining", "MegatronBertForMaskedLM"),
}
MODEL_TYPES = tuple(twin[0] for twin in _TWINS.values())
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # HF act -> --openai-gelu
_HF_NEEDS = {  # config.json key -> (transformers' default, the values our BERT can run)
    "hidden_act": ("gelu", tuple(_GELU)),
    "type_vocab_size": (2, (2,)),
    "position_embedding_type": ("absolute", ("absolute",)),
    "is_decoder": (False, (False,)),
}
_LAYER = {  # ours (under layers.{l}.) -> HF (under bert.encoder.layer.{l}.), besides qkv / norms
    "self_attention.dense": "attention.output.dense",
    "mlp.dense_h_to_4h": "intermediate.dense",
    "mlp.dense_4h_to_h": "output.dense",
}
_HEAD = {
    "head.lm_dense": "cls.predictions.transform.dense",
    "head.lm_layernorm": "cls.predictions.transform.LayerNorm",
    "head.pooler": "bert.pooler.dense",
    "head.binary_head": "cls.seq_relationship",
}
_EMB = {
    "embedding.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "embedding.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
}
_NSP = ("bert.pooler.dense.weight", "cls.seq_relationship.weight")


def hf_architecture(cfg: ModelConfig, binary_head: bool = True) -> str:
    """The transformers class that computes what this BERT computes (ValueError if none)."""
    problems = []
    if cfg.normalization != "LayerNorm":
        problems.append("--normalization LayerNorm")
    if cfg.swiglu:
        problems.append("no --swiglu (GeLU MLP)")
    if not cfg.add_bias_linear:
        problems.append("no --disable-bias-linear")
    if cfg.position_embedding_type != "learned":
        problems.append("--position-embedding-type learned")
    if cfg.query_groups != cfg.num_attention_heads:
        problems.append("no --num-query-groups (one key/value head per query head)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        problems.append("no --kv-channels (heads x head size = hidden size)")
    if cfg.num_unique_layers not in (None, cfg.num_layers):
        problems.append("no --num-unique-layers (no shared layers)")
    _, with_nsp, without = _TWINS[cfg.apply_residual_connection_post_layernorm]
    if problems:
        raise ValueError(
            f"this BERT has no Hugging Face twin: {with_nsp} would need " + "; ".join(problems)
        )
    return with_nsp if binary_head else without


def hf_bert_config(cfg: ModelConfig):
    """The transformers config (BertConfig or MegatronBertConfig) of this BERT's twin."""
    import transformers

    post_ln = cfg.apply_residual_connection_post_layernorm
    config_class = transformers.BertConfig if post_ln else transformers.MegatronBertConfig
    return config_class(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.ffn_size,
        hidden_act="gelu_new" if cfg.openai_gelu else "gelu",
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_positions,
        type_vocab_size=2,
        layer_norm_eps=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std,
    )


def _norm_names(cfg: ModelConfig) -> dict[str, str]:
    """Our norm module -> HF's (see the module docstring)."""
    layer = "bert.encoder.layer"
    if not cfg.apply_residual_connection_post_layernorm:
        names = {"head.final_layernorm": "bert.encoder.ln"}
        for i in range(cfg.num_layers):
            names[f"layers.{i}.input_layernorm"] = f"{layer}.{i}.attention.ln"
            names[f"layers.{i}.post_attention_layernorm"] = f"{layer}.{i}.ln"
        return names
    names = {"layers.0.input_layernorm": "bert.embeddings.LayerNorm"}
    for i in range(cfg.num_layers):
        last = i + 1 == cfg.num_layers
        nxt = "head.final_layernorm" if last else f"layers.{i + 1}.input_layernorm"
        names[nxt] = f"{layer}.{i}.output.LayerNorm"
        names[f"layers.{i}.post_attention_layernorm"] = f"{layer}.{i}.attention.output.LayerNorm"
    return names


def _module_map(cfg: ModelConfig) -> dict[str, str]:
    out = dict(_HEAD)
    out.update(_norm_names(cfg))
    for layer in range(cfg.num_layers):
        for ours, theirs in _LAYER.items():
            out[f"layers.{layer}.{ours}"] = f"bert.encoder.layer.{layer}.{theirs}"
    return out


def bert_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict -> the twin's (the padding vocab rows dropped)."""
    hf_architecture(cfg)
    v, n, d = cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    out = {theirs: sd[ours] for ours, theirs in _EMB.items()}
    out[_EMB["embedding.word_embeddings.weight"]] = sd["embedding.word_embeddings.weight"][:v]
    out["cls.predictions.bias"] = sd["head.lm_bias"][:v]
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    for ours, theirs in _module_map(cfg).items():
        for p in ("weight", "bias"):
            if f"{ours}.{p}" in sd:
                out[f"{theirs}.{p}"] = sd[f"{ours}.{p}"]
    for layer in range(cfg.num_layers):
        pre = f"layers.{layer}.self_attention.query_key_value"
        w = sd[f"{pre}.weight"].view(n, 3, d, -1)  # (heads, q/k/v, d, h)
        b = sd[f"{pre}.bias"].view(n, 3, d)
        for j, name in enumerate(("query", "key", "value")):
            hf = f"bert.encoder.layer.{layer}.attention.self.{name}"
            out[f"{hf}.weight"] = w[:, j].reshape(n * d, -1)
            out[f"{hf}.bias"] = b[:, j].reshape(n * d)
    return {k: t.detach().clone() for k, t in out.items()}


def hf_to_bert(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """The twin's state dict -> our full (TP = 1) one, padding rows zero."""
    hf_architecture(cfg)
    out = {ours: hf[theirs] for ours, theirs in _EMB.items()}
    out["embedding.word_embeddings.weight"] = _pad_rows(out[next(iter(_EMB))], padded_vocab)
    out["head.lm_bias"] = _pad_rows(hf["cls.predictions.bias"], padded_vocab)
    for ours, theirs in _module_map(cfg).items():
        for p in ("weight", "bias"):
            if f"{theirs}.{p}" in hf:
                out[f"{ours}.{p}"] = hf[f"{theirs}.{p}"]
    n, d = cfg.num_attention_heads, cfg.head_dim
    for layer in range(cfg.num_layers):
        hf_pre = f"bert.encoder.layer.{layer}.attention.self"
        qkv = [hf[f"{hf_pre}.{name}.weight"].view(n, d, -1) for name in ("query", "key", "value")]
        bias = [hf[f"{hf_pre}.{name}.bias"].view(n, d) for name in ("query", "key", "value")]
        pre = f"layers.{layer}.self_attention.query_key_value"
        out[f"{pre}.weight"] = torch.stack(qkv, 1).reshape(3 * n * d, -1)  # (n, 3, d, h)
        out[f"{pre}.bias"] = torch.stack(bias, 1).reshape(3 * n * d)
    return {k: t.detach().clone() for k, t in out.items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    pad = torch.zeros(rows - t.size(0), *t.shape[1:], dtype=t.dtype)
    return torch.cat([t, pad])


def export_hf_bert(full_state: dict, args: dict, out_dir: str) -> str:
    """Write `out_dir` for AutoModelForPreTraining.from_pretrained (safetensors, config,
    vocab.txt); return the architecture written."""
    import json
    import os
    import shutil

    cfg = model_config_from_saved(args["model"])
    architecture = hf_architecture(cfg, binary_head="head.pooler.weight" in full_state)
    tensors = bert_to_hf(full_state, cfg)
    tensors.pop("cls.predictions.decoder.weight")  # tied: the word embedding
    tensors.pop("cls.predictions.decoder.bias")  # tied: cls.predictions.bias
    os.makedirs(out_dir, exist_ok=True)
    tensors = {n: t.cpu().contiguous() for n, t in tensors.items()}
    save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    hf_cfg = hf_bert_config(cfg).to_dict()
    hf_cfg["architectures"] = [architecture]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    vocab = (args.get("tokenizer") or {}).get("vocab_file")
    if vocab and os.path.isfile(vocab):
        shutil.copyfile(vocab, os.path.join(out_dir, "vocab.txt"))
    return architecture


def _config_from_hf(hf_dir: str, hf_cfg: dict) -> ModelConfig:
    """The ModelConfig of a bert / megatron-bert config.json (ValueError for what ours lacks)."""
    for key, (default, allowed) in _HF_NEEDS.items():
        if hf_cfg.get(key, default) not in allowed:
            raise ValueError(
                f"--from-hf {hf_dir}: config.json {key} = {hf_cfg[key]!r} has no counterpart "
                f"here (it must be one of {', '.join(map(repr, allowed))})"
            )
    return ModelConfig(
        num_layers=hf_cfg["num_hidden_layers"],
        hidden_size=hf_cfg["hidden_size"],
        num_attention_heads=hf_cfg["num_attention_heads"],
        ffn_hidden_size=hf_cfg["intermediate_size"],
        seq_length=hf_cfg["max_position_embeddings"],
        max_position_embeddings=hf_cfg["max_position_embeddings"],
        vocab_size=hf_cfg["vocab_size"],
        hidden_dropout=hf_cfg.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf_cfg.get("attention_probs_dropout_prob", 0.1),
        layernorm_epsilon=hf_cfg.get("layer_norm_eps", 1e-12),
        init_method_std=hf_cfg.get("initializer_range", 0.02),
        openai_gelu=_GELU[hf_cfg.get("hidden_act", "gelu")],
        apply_residual_connection_post_layernorm=hf_cfg.get("model_type") == "bert",
    )


def _has_binary_head(hf_dir: str, hf: dict) -> bool:
    """Pooler and NSP head both (a *ForPreTraining file) or neither (*ForMaskedLM)."""
    if "cls.predictions.bias" not in hf:
        raise ValueError(
            f"--from-hf {hf_dir}: no MLM head (cls.predictions.*): save a *ForPreTraining or "
            "*ForMaskedLM model, not the bare encoder"
        )
    present = [name in hf for name in _NSP]
    if any(present) and not all(present):
        raise ValueError(
            f"--from-hf {hf_dir}: {' and '.join(_NSP)} come together (our NSP head runs on the "
            f"pooler); this file has only {_NSP[present.index(True)]}"
        )
    return all(present)


def import_hf_bert(hf_dir: str, hf_cfg: dict) -> tuple[dict, dict]:
    """(full state, checkpoint args at TP = PP = 1) of a (MegatronBert|Bert)ForPreTraining or
    ForMaskedLM directory (the latter gives a --bert-no-binary-head checkpoint)."""
    import os

    from safetensors.torch import load_file

    cfg = _config_from_hf(hf_dir, hf_cfg)
    path = os.path.join(hf_dir, "model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"--from-hf {hf_dir}: no model.safetensors (save with safetensors)")
    hf = load_file(path)
    if "cls.predictions.bias" not in hf and "cls.predictions.decoder.bias" in hf:
        hf["cls.predictions.bias"] = hf["cls.predictions.decoder.bias"]  # tied, either name
    binary_head = _has_binary_head(hf_dir, hf)
    state = hf_to_bert(hf, cfg, cfg.padded_vocab_size(1))
    for name in ("embedding.word_embeddings.weight", "head.lm_bias"):
        state[name] = state[name][: cfg.vocab_size]  # checkpoints hold the real vocab
    vocab = os.path.join(hf_dir, "vocab.txt")
    tokenizer = {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": os.path.abspath(vocab)}
    whole = whole_model_args(
        cfg,
        tokenizer if os.path.isfile(vocab) else {},
        state["embedding.word_embeddings.weight"].dtype,
    )
    args = {**whole, "model_family": "bert" if binary_head else "bert-no-binary-head"}
    return state, args
