"""Each checkpoint shard records how its tensors are split over TP, and conversion merges by
that record (shards without one, from before it existed, by the model code's rules)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron.checkpoint.resharding import (
    load_checkpoint,
    model_layout,
    partition_record,
    save_resharded,
    split_rule,
)
from megatron.checkpoint.storage import (
    finalize_checkpoint,
    load_shard,
    resolve_load_iteration,
    save_shard,
)
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.distributed import run_distributed
from tests.helpers.training import flags

SWIGLU = "layers.0.mlp.dense_h_to_4h.weight"  # split with stride 2: [gate_r; up_r] per rank


def _attributes(model) -> dict:
    """Name -> (partition_dim, partition_stride) or None, straight from the parameters."""
    return {
        name: (p.partition_dim, p.partition_stride)
        if getattr(p, "tensor_model_parallel", False)
        else None
        for chunk in model.module.chunks
        for name, p in chunk.named_parameters()
    }


def _train_and_read_own_shard(rank, world, argv, save):
    from megatron.config.cli import parse_args
    from megatron.config.rules import validate
    from megatron.training.loop import pretrain

    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    result = pretrain(cfg, out=open(os.devnull, "w"))
    shard = load_shard(save, result.iteration, tp_rank=rank, pp_rank=0, pp_size=1)
    return shard["partition"], _attributes(result.model), sorted(shard["model"])


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
    _, per_rank = tp2_checkpoint
    for rank, (record, attributes, names) in enumerate(per_rank):
        assert record == attributes, f"rank {rank}"
        assert sorted(record) == names, "every tensor of the shard is recorded"
        assert record[SWIGLU] == (0, 2) and record["head.output_layer.weight"] == (0, 1)
        assert record["layers.0.self_attention.dense.weight"] == (1, 1)
        assert record["layers.0.self_attention.dense.bias"] is None


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
    shard = load_shard(str(tmp_path / "tp2"), 5, tp_rank=1, pp_rank=0, pp_size=1)
    assert shard["partition"] == {n: split_rule(n, cfg) for n in shard["model"]}
    assert shard["partition"] == partition_record(model)
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
