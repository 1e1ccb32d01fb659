"""Each checkpoint shard records how its tensors are split over TP, and conversion merges by
that record (shards without one, from before it existed, by the model code's rules)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron.checkpoint.reading import load_shard, resolve_load_iteration
from megatron.checkpoint.resharding import (
    load_checkpoint,
    model_layout,
    partition_record,
    save_resharded,
)
from megatron.checkpoint.storage import finalize_checkpoint, save_shard
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.distributed import run_distributed
from tests.helpers.training import flags

SWIGLU = "layers.0.mlp.dense_h_to_4h.weight"  # split with stride 2: [gate_r; up_r] per rank


def _hand_written_record(num_layers: int, untied: bool) -> dict:
    """How TP splits each tensor of a GPT (learned positions, LayerNorm, biases, SwiGLU), written
    from the layer docs and not from the code that records it: the vocab-parallel embedding and
    head and the column-parallel QKV and h->4h split their rows (dim 0); the row-parallel dense
    and 4h->h their columns (dim 1); SwiGLU's h->4h holds [gate; up], and each rank holds its
    rows of both halves (stride 2); norms, positions and the row-parallel biases are whole."""
    record = {"embedding.word_embeddings.weight": (0, 1)}
    record["embedding.position_embeddings.weight"] = None
    for i in range(num_layers):
        layer = f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            record |= {f"{layer}{norm}.weight": None, f"{layer}{norm}.bias": None}
        for kind in ("weight", "bias"):
            record[f"{layer}self_attention.query_key_value.{kind}"] = (0, 1)
            record[f"{layer}mlp.dense_h_to_4h.{kind}"] = (0, 2)
        record[f"{layer}self_attention.dense.weight"] = (1, 1)
        record[f"{layer}self_attention.dense.bias"] = None
        record[f"{layer}mlp.dense_4h_to_h.weight"] = (1, 1)
        record[f"{layer}mlp.dense_4h_to_h.bias"] = None
    record |= {"head.final_layernorm.weight": None, "head.final_layernorm.bias": None}
    if untied:
        record["head.output_layer.weight"] = (0, 1)
    return record


def _by_hand(full: torch.Tensor, rule, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` under `rule` (dim, stride), cut here with chunk/cat."""
    if rule is None:
        return full
    dim, stride = rule
    parts = full.chunk(stride, dim)  # stride 2: [gate; up], each cut in tp pieces
    return torch.cat([part.chunk(tp, dim)[rank] for part in parts], dim)


def _train_and_read_own_shard(rank, world, argv, save):
    from megatron.config.cli import parse_args
    from megatron.config.rules import validate
    from megatron.training.loop import pretrain

    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    with open(os.devnull, "w") as out:
        result = pretrain(cfg, out=out)
    shard = load_shard(save, result.iteration, tp_rank=rank, pp_rank=0, pp_size=1)
    return shard["partition"], {n: tuple(t.shape) for n, t in shard["model"].items()}


@pytest.fixture(scope="module")
def tp2_checkpoint(data_prefix, tmp_path_factory):
    """A TP=2 checkpoint written by the trainer (SwiGLU, untied head: every kind of split)."""
    save = str(tmp_path_factory.mktemp("tp2") / "ck")
    extra = ["--tensor-model-parallel-size", "2", "--swiglu"]
    extra += ["--untie-embeddings-and-output-weights", "--save", save]
    argv = flags(data_prefix, *extra, iters=1)
    per_rank = run_distributed(_train_and_read_own_shard, 2, argv, save)
    return save, per_rank


@pytest.mark.slow
def test_trainer_shards_record_the_parameters_partition(tp2_checkpoint):
    """The record is the hand-written one, and each shard's shapes show that split: half the
    TP = 1 model's size along the recorded dim, the full shape where nothing is split."""
    _, per_rank = tp2_checkpoint
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    cfg = dataclasses.replace(cfg, vocab_size=128, make_vocab_size_divisible_by=8, swiglu=True)
    cfg = dataclasses.replace(cfg, untie_embeddings_and_output_weights=True)
    full = {n: tuple(t.shape) for n, t in GPTModel(cfg).state_dict().items()}
    expected = _hand_written_record(num_layers=2, untied=True)
    for rank, (record, shapes) in enumerate(per_rank):
        assert record == expected, f"rank {rank}"
        assert set(shapes) == set(full) == set(record), "every tensor of the shard is recorded"
        for name, shape in shapes.items():
            want = list(full[name])
            if record[name] is not None:
                want[record[name][0]] //= 2
            assert shape == tuple(want), f"rank {rank} {name}: {shape}, full {full[name]}"


def _rewrite(src: str, dst: str, edit) -> None:
    """Copy a TP=2 x PP=1 checkpoint's shards through `edit(shard, tp_rank)`."""
    iteration = resolve_load_iteration(src)
    for tp_rank in range(2):
        shard = load_shard(src, iteration, tp_rank=tp_rank, pp_rank=0, pp_size=1)
        edit(shard, tp_rank)
        save_shard(dst, iteration, shard, tp_rank=tp_rank, pp_rank=0, pp_size=1, write=True)
    finalize_checkpoint(dst, iteration, barrier=lambda: None, is_rank0=True, num_shards_expected=2)


@pytest.mark.slow
def test_record_and_legacy_paths_merge_a_tp2_checkpoint_identically(tp2_checkpoint, tmp_path):
    save, _ = tp2_checkpoint
    legacy = str(tmp_path / "legacy")
    _rewrite(save, legacy, lambda shard, _: shard.pop("partition"))
    recorded, old = load_checkpoint(save), load_checkpoint(legacy)
    assert list(recorded.state) == list(old.state)
    for name, tensor in recorded.state.items():
        assert torch.equal(tensor, old.state[name]), name


@pytest.mark.slow
def test_a_shard_is_merged_as_its_record_says(tp2_checkpoint, tmp_path):
    """Shards whose SwiGLU weight was split plainly (stride 1), with a record saying so: the
    record decides, and the model's rule (stride 2) would have merged them wrongly."""
    save, _ = tp2_checkpoint
    full = load_checkpoint(save).state[SWIGLU]

    def plain_split(shard, tp_rank):
        shard["model"][SWIGLU] = full.chunk(2)[tp_rank].clone()
        shard["partition"][SWIGLU] = (0, 1)

    plain = str(tmp_path / "plain")
    _rewrite(save, plain, plain_split)
    assert torch.equal(load_checkpoint(plain).state[SWIGLU], full)
    unrecorded = str(tmp_path / "unrecorded")
    _rewrite(plain, unrecorded, lambda shard, _: shard.pop("partition"))
    assert not torch.equal(load_checkpoint(unrecorded).state[SWIGLU], full)


def test_converted_shards_record_the_model_rules_and_reload(tmp_path):
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=70,
        make_vocab_size_divisible_by=8,
        swiglu=True,
    )
    model = GPTModel(cfg, BuildContext(seed=3))
    state = {
        n: t[:70] if n == "embedding.word_embeddings.weight" else t
        for n, t in model.state_dict().items()
    }
    args = {"model": dataclasses.asdict(cfg), "tensor_model_parallel_size": 1}
    args |= {"pipeline_model_parallel_size": 1, "padded_vocab_size": 72}
    save_resharded(state, args, str(tmp_path / "tp2"), 2, 1, 5, quiet=True)
    expected = _hand_written_record(num_layers=2, untied=False)
    padded = dict(state)  # the vocab rows zero-padded for TP = 2, as the shards hold them
    vocab = state["embedding.word_embeddings.weight"]
    pad = vocab.new_zeros(cfg.padded_vocab_size(2) - 70, vocab.shape[1])
    padded["embedding.word_embeddings.weight"] = torch.cat([vocab, pad])
    for rank in range(2):
        shard = load_shard(str(tmp_path / "tp2"), 5, tp_rank=rank, pp_rank=0, pp_size=1)
        assert shard["partition"] == expected, f"rank {rank}"
        assert set(shard["model"]) == set(expected)
        for name, rule in expected.items():  # the split the shards actually hold
            piece = _by_hand(padded[name], rule, 2, rank)
            assert torch.equal(shard["model"][name], piece), f"rank {rank} {name}"
    back = load_checkpoint(str(tmp_path / "tp2")).state
    assert all(torch.equal(back[n], t) for n, t in state.items())


def test_model_layout_is_the_model_itself():
    """Shapes and rules come from the (meta-device) model; its vocab rows are unpadded."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=70)
    shapes, rules = model_layout(cfg)
    model = GPTModel(cfg)
    assert list(shapes) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        rows = 70 if name == "embedding.word_embeddings.weight" else tensor.shape[0]
        assert shapes[name] == (rows, *tensor.shape[1:]), name
    assert rules == partition_record(model)
