"""Checkpoints made without the trainer, and damaged on purpose.

`_write_checkpoint` splits a TP = 1 model's weights into TP x PP shards by this file's own split
rules (written from the layer docs, not with mpu.shard; tests/checkpoint/test_convert_checkpoint.py
checks them against mpu.shard and the model's per-stage state dicts) and writes them with
save_shard, as the trainer's ranks would. `_damage` breaks a torch.save file in place,
`_FullDisk` fails every write, `_checkpoint_at` copies one iteration of a run."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import struct
import zipfile
from pathlib import Path

import torch

from megatron.checkpoint.reading import load_shard
from megatron.checkpoint.resharding import model_config, save_resharded
from megatron.checkpoint.storage import (
    SHARD_NAME,
    checkpoint_dir,
    finalize_checkpoint,
    save_shard,
    tracker_path,
    write_text_atomic,
)
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.stages import stage_layer_range
from megatron.models.gpt.model import GPTModel
from tests.helpers.models import LLAMA
from tests.helpers.paths import load_tool

VOCAB = ("embedding.word_embeddings.weight", "head.output_layer.weight")  # vocab-padded rows


def _args(cfg: ModelConfig, tp: int, pp: int, tokenizer: dict | None = None) -> dict:
    return {
        "model": dataclasses.asdict(cfg),
        "tokenizer": tokenizer or {"tokenizer_type": None},
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "padded_vocab_size": cfg.padded_vocab_size(tp),
        "params_dtype": "torch.float32",
    }


def _unpadded(model: GPTModel, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {n: t[: cfg.vocab_size] if n in VOCAB else t for n, t in model.state_dict().items()}


def _my_split(name: str, full: torch.Tensor, cfg: ModelConfig, tp: int, r: int) -> torch.Tensor:
    """This rank's slice, written from the layer docs (not with mpu.shard)."""
    if name in VOCAB:
        padded = cfg.padded_vocab_size(tp)
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], full.shape[1])])
        rows = padded // tp
        return full[r * rows : (r + 1) * rows].clone()
    suffix = name.split(".", 2)[2] if name.startswith("layers.") else name
    if suffix.startswith("self_attention.query_key_value"):
        g = cfg.query_groups
        groups = full.reshape(g, -1, *full.shape[1:])  # (groups, (n/g + 2) d, ...)
        return groups[r * g // tp : (r + 1) * g // tp].reshape(-1, *full.shape[1:]).clone()
    suffix = suffix.replace("mlp.shared_expert.", "mlp.")  # an MoE shared expert: an MLP
    if suffix.startswith("mlp.dense_h_to_4h"):
        if cfg.swiglu:
            gate, up = full.chunk(2)
            return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        return full.chunk(tp)[r].clone()
    if suffix == "self_attention.core.softmax_offset":  # one sink logit per head
        return full.chunk(tp)[r].clone()
    if suffix in ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight"):
        return full.chunk(tp, dim=1)[r].clone()
    return full.clone()


def _stage_keys(cfg: ModelConfig, pp: int, pp_rank: int) -> list[str]:
    """Names the trainer's stage model holds, from the model itself."""
    stage = GPTModel(
        cfg,
        BuildContext(seed=1),
        layer_range=stage_layer_range(cfg.num_layers, pp, pp_rank),
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
    )
    return list(stage.state_dict())


def _write_checkpoint(root, model, cfg, tp, pp, iteration=20, tokenizer=None) -> None:
    full = _unpadded(model, cfg)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = {
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "consumed_train_samples": 640,
                "consumed_valid_samples": 32,
                "model": {
                    n: _my_split(n, full[n], cfg, tp, tp_rank)
                    for n in _stage_keys(cfg, pp, pp_rank)
                },
                "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}},
                "opt_param_scheduler": {"num_steps": iteration, "max_lr": 1e-3},
                "rng_state": {"torch": torch.get_rng_state()},
                "args": _args(cfg, tp, pp, tokenizer),
            }
            save_shard(
                str(root),
                iteration,
                shard,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                pp_size=pp,
                write=True,
            )
    finalize_checkpoint(
        str(root), iteration, barrier=lambda: None, is_rank0=True, num_shards_expected=tp * pp
    )


def _cli():
    """tools/convert_checkpoint.py's main(argv)."""
    return load_tool("convert_checkpoint").main


def _member_data(path, name_suffix: str) -> tuple[int, int]:
    """(offset, length) of the bytes of the zip member ending in `name_suffix` in a torch.save
    file (the local header's extra field pads tensors for alignment, so read it)."""
    raw = Path(path).read_bytes()
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name_suffix))
    name_len, extra_len = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def _overwrite(path, offset: int, data: bytes) -> None:
    """Damage in place: same size, so the marker's size check cannot notice."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    assert os.path.getsize(path) == size


def _damage(path, where: str) -> None:
    """Damage a torch.save file in place: 1 KiB inside its largest tensor, or 4 bytes of its
    pickle (what fails today with "'utf-8' codec can't decode byte 0x85", naming no file)."""
    if where == "tensor data":
        with zipfile.ZipFile(path) as z:
            largest = max(
                (i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
            )
        start, length = _member_data(path, largest.filename)
        assert length >= 2048, "the tensor must be large enough to hold 1 KiB of damage"
        _overwrite(path, start + length // 2 - 512, bytes(range(256)) * 4)
    else:
        start, _ = _member_data(path, "data.pkl")
        _overwrite(path, start + 28, b"\x85" * 4)


def _checkpoint_at(src: str, iteration: int, dst) -> str:
    """A copy of `src` whose pointer names `iteration` (resume from the middle of a run)."""
    shutil.copytree(checkpoint_dir(src, iteration), checkpoint_dir(str(dst), iteration))
    write_text_atomic(tracker_path(str(dst)), f"{iteration}\n")
    return str(dst)


class _FullDisk:
    """A file opened for writing on a full disk: every write fails with ENOSPC."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def full_disk_on_rank1(rank: int):
    """An `open` for megatron.checkpoint.storage under which rank 1's shard of iteration 4
    meets a full disk (every other file opens as usual)."""
    real_open = open

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        name = os.path.basename(file)
        if rank == 1 and "iter_0000004" in os.fspath(file) and name.startswith(f".{SHARD_NAME}."):
            return _FullDisk(f)
        return f

    return full_open


# The two architectures the conversion tests (and the MoE ones) cut, export and import.
_COMMON = dict(
    num_layers=4,
    seq_length=16,
    vocab_size=70,  # padded: 72 at TP=1, 80 at TP=2, 96 at TP=4 (divisible by 8)
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
VARIANTS = {
    # GPT-2: learned positions, LayerNorm, GeLU, biases, tied embeddings.
    "gpt2": ModelConfig(hidden_size=32, num_attention_heads=4, **_COMMON),
    # Llama-style: RoPE, RMSNorm, SwiGLU, GQA (8 heads, 4 groups), untied, no biases.
    "llama": ModelConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        **LLAMA,
        untie_embeddings_and_output_weights=True,
        **_COMMON,
    ),
}


def _model(cfg: ModelConfig, seed: int = 7) -> GPTModel:
    """A model whose biases and norm weights are not 0 and 1, so their mapping is tested too."""
    model = GPTModel(cfg, BuildContext(seed=seed, dtype=torch.float32)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            if name in VOCAB:
                p[cfg.vocab_size :] = 0.0  # padding rows stay zero, as at init
    return model


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(5)
    )


@torch.no_grad()
def _logits(model: GPTModel, cfg: ModelConfig) -> torch.Tensor:
    return model(_tokens(cfg))[..., : cfg.vocab_size]


def save_jittered_hf(hf, out_dir: str) -> None:
    """Save a transformers model built from a config, its weights moved off their init (seeded)
    so every mapping is tested."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    hf.save_pretrained(out_dir)


def model_from_full_state(state: dict, args: dict, ckpt_dir: str) -> GPTModel:
    """The TP 1 model that loads `state` (an import) through a resharded checkpoint."""
    save_resharded(state, args, ckpt_dir, 1, 1, 0, quiet=True)
    model = _model(model_config(args), seed=11)
    model.load_state_dict(load_shard(ckpt_dir, 0, tp_rank=0, pp_rank=0, pp_size=1)["model"])
    return model
