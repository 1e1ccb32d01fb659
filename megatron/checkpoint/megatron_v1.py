"""Import a GPT checkpoint written by Megatron-LM v1.x (v1.1.5, DeepSpeedExamples' 3D fork).

Two layouts are read, at any TP size (PP = 1):
- v1.x's own: `latest_checkpointed_iteration.txt`, `iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`
  (or `release/`), each holding `model` = {language_model: {embedding: ..., transformer: ...}};
- its `--deepspeed` engine's: `latest`, `<tag>/mp_rank_XX_model_states.pt` holding `module`
  = the flat GPT2Model state dict (`language_model.embedding.word_embeddings.weight`, ...).
The DeepSpeed pipeline's per-layer files (GPT2ModelPipe, `layer_XX-model_XX-model_states.pt`)
are refused with the fix (convert them with DeepSpeed to the non-pipeline layout first).

What differs from our layout and is converted:
- names: `language_model.embedding.*` -> `embedding.*`, `language_model.transformer.X` -> `X`,
  `.attention.` -> `.self_attention.`; with --num-unique-layers v1 numbers its distinct layers
  0..U-1, we name each by the first layer that runs it;
- the fused QKV rows: checkpoint_version 2.0 (v1.1.5) holds per TP rank [heads, (q, k, v), d],
  ours; version 0 [(q, k, v), heads, d] and 1.0 [heads, d, (q, k, v)] are reordered to it;
- the vocab padding: v1 pads the embedding to `padded_vocab_size` and lets the padding rows take
  softmax mass; here they are masked, so `vocab_size` (the tokenizer's) is what the model keeps
  and the rows after it are dropped. With vocab_size = padded_vocab_size nothing is dropped and
  the losses are v1's exactly (tested against v1.1.5's own model code).

The pickles are read with torch.load(weights_only=True), allowing beyond tensors, containers and
torch dtypes only argparse.Namespace and numpy arrays (an exact list of numpy's reconstructors
and dtypes; no module named in the file is imported); objects of v1's own classes (its fp16 loss
scaler, in the optimizer state) become inert placeholders, since only the weights are imported;
any other class is refused before loading, naming the file and the class.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import torch

from megatron.checkpoint.resharding import check_full_state, whole_model_args
from megatron.checkpoint.storage import CheckpointError
from megatron.config.schema import ModelConfig

NATIVE_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"
_V1_PACKAGES = ("megatron", "apex", "deepspeed", "fp16")  # their objects become placeholders


class _Placeholder:
    """Stands in for an object of a class this project does not have (v1's loss scaler)."""


def _numpy_globals() -> dict[str, object]:
    """The exact numpy globals a pickled array or dtype names, under numpy 1.x (numpy.core) and
    2.x (numpy._core) spellings, resolved from numpy's own attributes: no module is imported by
    a name read from the file (importing a crafted one, numpy.f2py.__main__, ran its CLI)."""
    import numpy as np

    core = getattr(np, "_core", None)
    multiarray = core.multiarray if core is not None else np.core.multiarray  # numpy < 2
    out = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for package in ("numpy.core", "numpy._core"):
        out[f"{package}.multiarray._reconstruct"] = multiarray._reconstruct
        out[f"{package}.multiarray.scalar"] = multiarray.scalar
    # numpy >= 1.25 builds a dtype as its class (numpy.dtypes.Float32DType, ...)
    for name, cls in vars(getattr(np, "dtypes", object)).items():
        if name.endswith("DType") and isinstance(cls, type):
            out[f"numpy.dtypes.{name}"] = cls
    return out


def _allowed(qualified: str, numpy_globals: dict[str, object]):
    """What torch.load(weights_only=True) may resolve `qualified` to, or None (refused)."""
    module, _, name = qualified.rpartition(".")
    if qualified == "argparse.Namespace":
        return argparse.Namespace
    if qualified in numpy_globals:
        return (numpy_globals[qualified], qualified)
    if module.split(".")[0] in _V1_PACKAGES:  # only weights are imported: an inert stand-in
        return (type(name, (_Placeholder,), {}), qualified)
    return None


def _load(path: str) -> dict:
    """torch.load(weights_only=True) of a v1.x file, allowing only the globals it needs."""
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        numpy_globals = _numpy_globals() if any(q.startswith("numpy.") for q in needed) else {}
        allowed = []
        for qualified in needed:
            found = _allowed(qualified, numpy_globals)
            if found is None:
                raise CheckpointError(
                    f"{path}: holds an object of {qualified}, which a Megatron-LM v1.x checkpoint "
                    "does not; refusing to unpickle it (only tensors, containers, "
                    "argparse.Namespace and numpy arrays are read)"
                )
            allowed.append(found)
            if qualified == "numpy.dtype":  # the dtype classes it is built as
                allowed += [
                    (c, q) for q, c in numpy_globals.items() if q.startswith("numpy.dtypes")
                ]
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(
            f"{path}: cannot be read as a Megatron-LM v1.x checkpoint ({e})"
        ) from e


# ------------------------------------------------------------------------------ layout


@dataclasses.dataclass
class V1Checkpoint:
    iteration: int
    shards: list[str]  # one file per TP rank
    layout: str  # "megatron" | "deepspeed"


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def find_v1_checkpoint(load_dir: str, iteration: int | None = None) -> V1Checkpoint:
    """The files of the newest (or the given) v1.x checkpoint in `load_dir`."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--from-megatron-v1 {load_dir}: no such directory")
    native = os.path.join(load_dir, NATIVE_TRACKER)
    ds = os.path.join(load_dir, DEEPSPEED_TRACKER)
    if iteration is None and os.path.isfile(native):
        text = _read_text(native)
        iteration = 0 if text == "release" else int(text)
    if iteration is not None or os.path.isfile(native):
        name = (
            "release"
            if iteration == 0 and os.path.isdir(os.path.join(load_dir, "release"))
            else f"iter_{iteration:07d}"
        )
        directory = os.path.join(load_dir, name)
        shards = sorted(
            os.path.join(directory, d, "model_optim_rng.pt")
            for d in (os.listdir(directory) if os.path.isdir(directory) else [])
            if re.fullmatch(r"mp_rank_\d\d", d)
        )
        if shards:
            return V1Checkpoint(iteration, shards, "megatron")
        if not os.path.isfile(ds):
            raise CheckpointError(
                f"--from-megatron-v1 {load_dir}: {directory} holds no mp_rank_XX/model_optim_rng.pt"
            )
    if not os.path.isfile(ds):
        raise CheckpointError(
            f"--from-megatron-v1 {load_dir}: neither {NATIVE_TRACKER} (Megatron-LM v1.x) nor "
            f"{DEEPSPEED_TRACKER} (its --deepspeed engine) is there; is it a v1.x checkpoint?"
        )
    tag = _read_text(ds)
    directory = os.path.join(load_dir, tag)
    files = os.listdir(directory) if os.path.isdir(directory) else []
    if any(re.fullmatch(r"layer_\d+-model_\d+-model_states\.pt", f) for f in files):
        raise CheckpointError(
            f"--from-megatron-v1 {load_dir}: {directory} is a DeepSpeed pipeline checkpoint "
            "(GPT2ModelPipe, one file per layer), which this importer does not read. Fix: "
            "import one saved without --pipe-parallel-size, or merge it with DeepSpeed's "
            "checkpoint tools first"
        )
    shards = sorted(
        os.path.join(directory, f)
        for f in files
        if re.fullmatch(r"mp_rank_\d\d_model_states\.pt", f)
    )
    if not shards:
        raise CheckpointError(
            f"--from-megatron-v1 {load_dir}: {directory} holds no mp_rank_XX_model_states.pt"
        )
    step = re.search(r"(\d+)$", tag)
    return V1Checkpoint(int(step.group(1)) if step else 0, shards, "deepspeed")


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ------------------------------------------------------------------------------ conversion


def _qkv_to_v2(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """One TP rank's fused QKV rows (or bias) in v1.1.5's [heads, 3, d] order."""
    rest = t.shape[1:]
    if version == 0:  # [3, heads, d]
        return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)
    if version == 1.0:  # [heads, d, 3]
        return t.reshape(heads, -1, 3, *rest).transpose(1, 2).reshape(t.shape)
    return t


# Our name -> (v1.x name, TP split dim or None for replicated).
def _name_map(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
    m = {
        "embedding.word_embeddings.weight": ("language_model.embedding.word_embeddings.weight", 0),
        "embedding.position_embeddings.weight": (
            "language_model.embedding.position_embeddings.weight",
            None,
        ),
        "head.final_layernorm.weight": ("language_model.transformer.final_layernorm.weight", None),
        "head.final_layernorm.bias": ("language_model.transformer.final_layernorm.bias", None),
    }
    per_layer = {
        "input_layernorm.weight": ("input_layernorm.weight", None),
        "input_layernorm.bias": ("input_layernorm.bias", None),
        "self_attention.query_key_value.weight": ("attention.query_key_value.weight", 0),
        "self_attention.query_key_value.bias": ("attention.query_key_value.bias", 0),
        "self_attention.dense.weight": ("attention.dense.weight", 1),
        "self_attention.dense.bias": ("attention.dense.bias", None),
        "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
        "post_attention_layernorm.bias": ("post_attention_layernorm.bias", None),
        "mlp.dense_h_to_4h.weight": ("mlp.dense_h_to_4h.weight", 0),
        "mlp.dense_h_to_4h.bias": ("mlp.dense_h_to_4h.bias", 0),
        "mlp.dense_4h_to_h.weight": ("mlp.dense_4h_to_h.weight", 1),
        "mlp.dense_4h_to_h.bias": ("mlp.dense_4h_to_h.bias", None),
    }
    for i in range(cfg.num_layers):
        owner, unique = cfg.layer_owner(i), cfg.unique_layer(i)
        for ours, (theirs, dim) in per_layer.items():
            m[f"layers.{owner}.{ours}"] = (
                f"language_model.transformer.layers.{unique}.{theirs}",
                dim,
            )
    return m


def _model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=get("seq_length") or args.max_position_embeddings,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
        hidden_dropout=get("hidden_dropout", 0.1),
        attention_dropout=get("attention_dropout", 0.1),
        init_method_std=get("init_method_std", 0.02),
        layernorm_epsilon=get("layernorm_epsilon", 1e-5),
        apply_query_key_layer_scaling=bool(get("apply_query_key_layer_scaling", False)),
        openai_gelu=bool(get("openai_gelu", False)),
        apply_residual_connection_post_layernorm=bool(
            get("apply_residual_connection_post_layernorm", False)
        ),
        num_unique_layers=get("num_unique_layers"),
        param_sharing_style=get("param_sharing_style", "grouped"),
    )


def _tokenizer(args: argparse.Namespace) -> dict:
    return {
        "tokenizer_type": getattr(args, "tokenizer_type", None),
        "vocab_file": getattr(args, "vocab_file", None),
        "merge_file": getattr(args, "merge_file", None),
        "tokenizer_model": None,
    }


def import_megatron_v1(
    load_dir: str, vocab_size: int | None = None, iteration: int | None = None
) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(full state at TP = PP = 1, checkpoint args, iteration) of a v1.x GPT checkpoint.

    `vocab_size`: the tokenizer's (rows after it are v1's padding, dropped); default: the
    recorded tokenizer's files if they exist, else an error asking for it."""
    found = find_v1_checkpoint(load_dir, iteration)
    shards, args, version = [], None, None
    for path in found.shards:
        raw = _load(path)
        if found.layout == "deepspeed":
            model, args = raw.get("module"), raw.get("args", args)
            version = raw.get("checkpoint_version", version)
        else:
            model, args, version = (
                raw.get("model"),
                raw.get("args", args),
                raw.get("checkpoint_version", 0),
            )
        if not isinstance(model, dict):
            raise CheckpointError(f"{path}: no model weights (`model` / `module`) in it")
        shards.append(_flatten(model))
        del raw
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(
            f"{found.shards[0]}: no v1.x `args` in it (the model's shape is unknown)"
        )
    tp = len(shards)
    saved_tp = getattr(args, "model_parallel_size", tp)
    if saved_tp != tp:
        raise CheckpointError(
            f"{os.path.dirname(found.shards[0])}: args say --model-parallel-size {saved_tp} "
            f"but {tp} mp_rank files are there"
        )
    if getattr(args, "pipe_parallel_size", 0) > 1:
        raise CheckpointError(f"{load_dir}: saved with --pipe-parallel-size > 1 (unsupported)")
    if getattr(args, "num_tokentypes", 0) or "language_model.pooler.dense.weight" in shards[0]:
        raise CheckpointError(f"{load_dir}: a BERT checkpoint; this importer reads GPT-2 only")
    padded = shards[0]["language_model.embedding.word_embeddings.weight"].shape[0] * tp
    vocab_size = vocab_size or _tokenizer_vocab_size(args, load_dir, padded)
    if not 0 < vocab_size <= padded:
        raise CheckpointError(
            f"--vocab-size {vocab_size}: must be between 1 and the checkpoint's padded vocabulary "
            f"{padded}"
        )
    cfg = _model_config(args, vocab_size)
    heads = cfg.num_attention_heads // tp
    version = 0 if version is None else float(version)
    state = {}
    for ours, (theirs, dim) in _name_map(cfg).items():
        if ours in state:
            continue
        missing = [r for r, s in enumerate(shards) if theirs not in s]
        if missing:
            raise CheckpointError(
                f"{found.shards[missing[0]]}: has no {theirs}; not a v1.x GPT-2 checkpoint of "
                f"{cfg.num_layers} layers"
            )
        pieces = [s.pop(theirs) for s in shards]
        if "query_key_value" in theirs:
            pieces = [_qkv_to_v2(p, version, heads) for p in pieces]
        full = pieces[0] if dim is None else torch.cat(pieces, dim=dim)
        state[ours] = full.float() if full.dtype == torch.float16 else full
    for s in shards:  # v1 keeps no other tensors in a GPT-2 model
        left = [n for n in s if torch.is_tensor(s[n])]
        if left:
            raise CheckpointError(f"{load_dir}: tensors not understood: {', '.join(left[:6])}")
    words = "embedding.word_embeddings.weight"
    state[words] = state[words][:vocab_size].contiguous()
    state = {n: t.contiguous() for n, t in state.items()}
    check_full_state(state, cfg, f"--from-megatron-v1 {load_dir}")
    out_args = whole_model_args(cfg, _tokenizer(args), state[words].dtype)
    return state, out_args, found.iteration


def _tokenizer_vocab_size(args: argparse.Namespace, load_dir: str, padded: int) -> int:
    """The size of the vocabulary file the v1.x run named, if it is readable here: GPT-2 BPE's
    vocab.json (its entries) or a WordPiece vocab.txt (its lines), as v1.x's tokenizers count."""
    tok = _tokenizer(args)
    path = tok["vocab_file"]
    if tok["tokenizer_type"] and path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if tok["tokenizer_type"] == "GPT2BPETokenizer":
                return len(json.load(f))
            return sum(1 for line in f if line.strip())
    raise CheckpointError(
        f"--from-megatron-v1 {load_dir}: the tokenizer it was trained with "
        f"({tok['tokenizer_type']}, {tok['vocab_file']}) is not readable here, so its vocabulary "
        f"size is unknown (v1.x padded it to {padded}). Fix: pass --vocab-size N (50257 for "
        f"GPT-2's BPE), or --vocab-size {padded} to keep every padded row"
    )
