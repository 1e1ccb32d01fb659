"""BertModel <-> Hugging Face BertForPreTraining, on full (TP = 1, merged) state dicts.

The original BERT is post-LN, so only a model built with
--apply-residual-connection-post-layernorm has an HF twin. Its norms are ours renamed
(models/bert/model.py): embeddings.LayerNorm = layers.0.input_layernorm; layer l's
attention.output.LayerNorm = layers.l.post_attention_layernorm; layer l's output.LayerNorm =
layers.(l+1).input_layernorm, or head.final_layernorm for the last layer.

query_key_value rows are per head [q_i, k_i, v_i] (one query per key/value group), so
W_qkv.view(n, 3, d, h)[:, j] stacks the heads of q (j = 0), k (1) or v (2).
"""

from __future__ import annotations

import torch

from megatron.config.schema import ModelConfig, model_config_from_saved

_LAYER = {  # ours (under layers.{l}.) -> HF (under bert.encoder.layer.{l}.), besides qkv / norms
    "self_attention.dense": "attention.output.dense",
    "post_attention_layernorm": "attention.output.LayerNorm",
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


def check_convertible(cfg: ModelConfig) -> None:
    problems = []
    if not cfg.apply_residual_connection_post_layernorm:
        problems.append("pre-LN layers (train with --apply-residual-connection-post-layernorm)")
    if cfg.normalization != "LayerNorm" or cfg.swiglu or not cfg.add_bias_linear:
        problems.append("only LayerNorm, GeLU and linear biases")
    if cfg.position_embedding_type != "learned" or cfg.query_groups != cfg.num_attention_heads:
        problems.append("only learned positions and one key/value head per query head")
    if cfg.num_unique_layers not in (None, cfg.num_layers):
        problems.append("no shared layers (--num-unique-layers)")
    if problems:
        raise ValueError(
            "this BERT has no Hugging Face BertForPreTraining twin: " + "; ".join(problems)
        )


def hf_bert_config(cfg: ModelConfig, binary_head: bool = True):
    from transformers import BertConfig

    return BertConfig(
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
    names = {"layers.0.input_layernorm": "bert.embeddings.LayerNorm"}
    for layer in range(cfg.num_layers):
        nxt = (
            f"layers.{layer + 1}.input_layernorm"
            if layer + 1 < cfg.num_layers
            else "head.final_layernorm"
        )
        names[nxt] = f"bert.encoder.layer.{layer}.output.LayerNorm"
    return names


def _module_map(cfg: ModelConfig) -> dict[str, str]:
    out = dict(_HEAD)
    out.update(_norm_names(cfg))
    for layer in range(cfg.num_layers):
        for ours, theirs in _LAYER.items():
            out[f"layers.{layer}.{ours}"] = f"bert.encoder.layer.{layer}.{theirs}"
    return out


def bert_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict -> BertForPreTraining's (the padding vocab rows dropped)."""
    check_convertible(cfg)
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
    """BertForPreTraining's state dict -> our full (TP = 1) one, padding rows zero."""
    check_convertible(cfg)
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


def export_hf_bert(full_state: dict, args: dict, out_dir: str) -> None:
    """Write `out_dir` for BertForPreTraining.from_pretrained: safetensors, config, vocab.txt."""
    import json
    import os
    import shutil

    from safetensors.torch import save_file

    cfg = model_config_from_saved(args["model"])
    if args.get("model_family") == "bert-no-binary-head":
        raise ValueError("BertForPreTraining has an NSP head; this BERT was trained without one")
    tensors = bert_to_hf(full_state, cfg)
    tensors.pop("cls.predictions.decoder.weight")  # tied: the word embedding
    tensors.pop("cls.predictions.decoder.bias")  # tied: cls.predictions.bias
    os.makedirs(out_dir, exist_ok=True)
    tensors = {n: t.cpu().contiguous() for n, t in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = hf_bert_config(cfg).to_dict()
    hf_cfg["architectures"] = ["BertForPreTraining"]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    vocab = (args.get("tokenizer") or {}).get("vocab_file")
    if vocab and os.path.isfile(vocab):
        shutil.copyfile(vocab, os.path.join(out_dir, "vocab.txt"))


def import_hf_bert(hf_dir: str, hf_cfg: dict) -> tuple[dict, dict]:
    """(full state, checkpoint args at TP = PP = 1) of a BertForPreTraining directory."""
    import dataclasses
    import os

    from safetensors.torch import load_file

    cfg = ModelConfig(
        num_layers=hf_cfg["num_hidden_layers"],
        hidden_size=hf_cfg["hidden_size"],
        num_attention_heads=hf_cfg["num_attention_heads"],
        ffn_hidden_size=hf_cfg["intermediate_size"],
        seq_length=hf_cfg["max_position_embeddings"],
        max_position_embeddings=hf_cfg["max_position_embeddings"],
        vocab_size=hf_cfg["vocab_size"],
        layernorm_epsilon=hf_cfg.get("layer_norm_eps", 1e-12),
        init_method_std=hf_cfg.get("initializer_range", 0.02),
        openai_gelu=hf_cfg.get("hidden_act", "gelu") in ("gelu_new", "gelu_pytorch_tanh"),
        apply_residual_connection_post_layernorm=True,
    )
    path = os.path.join(hf_dir, "model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"--from-hf {hf_dir}: no model.safetensors (save with safetensors)")
    hf = load_file(path)
    state = hf_to_bert(hf, cfg, cfg.padded_vocab_size(1))
    state["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"][
        : cfg.vocab_size
    ]
    state["head.lm_bias"] = state["head.lm_bias"][: cfg.vocab_size]
    vocab = os.path.join(hf_dir, "vocab.txt")
    tokenizer = {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": os.path.abspath(vocab)}
    args = {
        "model": dataclasses.asdict(cfg),
        "tokenizer": tokenizer if os.path.isfile(vocab) else {},
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "padded_vocab_size": cfg.padded_vocab_size(1),
        "params_dtype": str(state["embedding.word_embeddings.weight"].dtype),
        "model_family": "bert",
    }
    return state, args
