"""Checkpoints written by Megatron-LM v1.1.5 itself import with the per-token losses that v1.1.5's
own model computed, at TP 1 and 2, in its native and --deepspeed layouts and its older QKV
orders, and the trainer continues from them.

tests/fixtures/megatron_v1/tp{1,2} were written by make_fixture.py there, which runs
DeepSpeedExamples' Megatron-LM-v1.1.5-3D_parallelism model code on CPU ranks (apex's
FusedLayerNorm replaced by torch's LayerNorm), weights moved far from their init, and saves
them as v1.1.5's save_checkpoint does, with the losses of its forward (expected.json).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch

from megatron.checkpoint.megatron_v1 import _load, import_megatron_v1
from megatron.checkpoint.resharding import load_full_state, model_config
from megatron.checkpoint.storage import CheckpointError
from megatron.models.gpt.model import GPTModel
from tests.helpers.checkpoints import _cli
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import FIXTURES
from tests.helpers.training import _train

SHARD = os.path.join("iter_0000007", "mp_rank_{:02d}", "model_optim_rng.pt")


def _fixture(tp: int) -> str:
    return os.path.join(FIXTURES, "megatron_v1", f"tp{tp}")


def _v1_losses(state: dict, args: dict, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(our model's per-token losses with `state`, v1.1.5's own) on the fixture's tokens."""
    with open(os.path.join(_fixture(tp), "expected.json")) as f:
        expected = json.load(f)
    model = GPTModel(model_config(args))
    words = "embedding.word_embeddings.weight"
    padded = model.state_dict()[words].shape[0]  # our padding rows: zeros, their logits masked
    rows = state[words].shape[0]
    model.load_state_dict(
        {
            **state,
            words: torch.cat(
                [state[words], state[words].new_zeros(padded - rows, state[words].shape[1])]
            ),
        }
    )
    model.eval()
    tokens = torch.tensor(expected["tokens"])
    with torch.no_grad():
        ours = model(tokens[:, :-1], labels=tokens[:, 1:])
    return ours, torch.tensor(expected["losses"])


@pytest.mark.parametrize("tp", [1, 2])
def test_v115_checkpoint_gives_v115s_losses_and_converts_to_any_tp(tp, tmp_path):
    state, args, iteration = import_megatron_v1(_fixture(tp), vocab_size=128)
    assert iteration == 7 and args["model"]["num_layers"] == 2
    ours, theirs = _v1_losses(state, args, tp)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    # Through the tool, to our layout at another TP: the same full state comes back.
    out = str(tmp_path / "ours")
    argv = ["--from-megatron-v1", _fixture(tp), "--save", out, "--vocab-size", "128"]
    assert _cli()([*argv, "--target-tensor-model-parallel-size", str(3 - tp)]) == 0
    full, saved_args = load_full_state(out)
    assert saved_args["tensor_model_parallel_size"] == 3 - tp
    for name, tensor in state.items():
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=0, msg=name)
    # The tokenizer's size drops v1's padding rows (which took softmax mass there).
    small, small_args, _ = import_megatron_v1(_fixture(tp), vocab_size=100)
    assert small["embedding.word_embeddings.weight"].shape[0] == 100
    ours100, _ = _v1_losses(small, small_args, tp)
    assert (ours100 < theirs).all(), "without the padding's mass every loss is lower"


def _rewrite(tp: int, dst, transform) -> str:
    """A copy of the TP fixture whose shards went through transform(dict) -> dict."""
    shutil.copytree(_fixture(tp), dst)
    for r in range(tp):
        path = os.path.join(dst, SHARD.format(r))
        torch.save(transform(_load(path)), path)
    return str(dst)


def _older_qkv(version: float):
    """v1.1.5's [heads, 3, d] QKV rows rewritten in the order of checkpoint_version 0 / 1.0."""

    def transform(shard):
        layers = shard["model"]["language_model"]["transformer"]
        for name, t in layers.items():
            if "query_key_value" in name:
                heads = 2  # 4 heads over TP = 2
                v = t.reshape(heads, 3, -1, *t.shape[1:])
                order = v.transpose(0, 1) if version == 0 else v.transpose(1, 2)
                layers[name] = order.reshape(t.shape).contiguous()
        shard["checkpoint_version"] = version
        return shard

    return transform


def test_deepspeed_layout_and_older_qkv_orders_import_the_same(tmp_path):
    want, _, _ = import_megatron_v1(_fixture(2), vocab_size=128)
    for version in (0, 1.0):
        root = _rewrite(2, tmp_path / f"v{version}", _older_qkv(version))
        got, _, _ = import_megatron_v1(root, vocab_size=128)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=f"{version} {name}")
    # v1.x under --deepspeed (no pipeline): `latest` + global_step7/mp_rank_XX_model_states.pt,
    # holding the flat GPT2Model state dict under `module`.
    ds = tmp_path / "ds"
    (ds / "global_step7").mkdir(parents=True)
    (ds / "latest").write_text("global_step7")
    for r in range(2):
        shard = _load(os.path.join(_fixture(2), SHARD.format(r)))
        flat = {}
        for scope, sub in shard["model"]["language_model"].items():
            for key, value in sub.items() if scope == "transformer" else _flat(sub):
                flat[f"language_model.{scope}.{key}"] = value
        module = {"module": flat, "args": shard["args"], "checkpoint_version": 2.0}
        torch.save(module, ds / "global_step7" / f"mp_rank_{r:02d}_model_states.pt")
    got, _, iteration = import_megatron_v1(str(ds), vocab_size=128)
    assert iteration == 7
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=f"deepspeed {name}")


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_bad_input_is_named_and_nothing_foreign_is_unpickled(tmp_path, capsys):
    main = _cli()
    # The tokenizer files the checkpoint names are not here: its size must be given.
    assert main(["--from-megatron-v1", _fixture(1), "--save", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "--vocab-size" in err and "padded it to 128" in err
    assert not os.path.exists(tmp_path / "a")
    # With the GPT-2 vocab.json the run named readable here, its size is the default.
    vocab = tmp_path / "gpt2-vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(100)}))

    def renamed(shard):
        shard["args"].vocab_file = str(vocab)
        return shard

    state, args, _ = import_megatron_v1(_rewrite(1, tmp_path / "named", renamed))
    assert args["model"]["vocab_size"] == 100 and args["tokenizer"]["vocab_file"] == str(vocab)
    assert state["embedding.word_embeddings.weight"].shape[0] == 100
    # A pipeline checkpoint of its --deepspeed engine is refused with the fix.
    pipe = tmp_path / "pipe"
    (pipe / "global_step3").mkdir(parents=True)
    (pipe / "latest").write_text("global_step3")
    (pipe / "global_step3" / "layer_00-model_00-model_states.pt").write_bytes(b"")
    assert main(["--from-megatron-v1", str(pipe), "--save", str(tmp_path / "b")]) == 1
    assert "DeepSpeed pipeline checkpoint" in capsys.readouterr().err
    # An object of any other class is never unpickled (os.system is not called).
    root = _rewrite(1, tmp_path / "evil", lambda shard: {**shard, "extra": Evil()})
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        import_megatron_v1(root, vocab_size=128)
    assert "pwned" not in capsys.readouterr().out
    # v1's fp16 optimizer state holds objects of its own classes: inert stand-ins here.
    fake = types.ModuleType("megatron.fp16.loss_scaler")
    fake.DynamicLossScaler = type("DynamicLossScaler", (), {"__module__": fake.__name__})
    scaler = fake.DynamicLossScaler()
    scaler.cur_scale = 4096.0
    with mock.patch.dict(sys.modules, {fake.__name__: fake}):
        root = _rewrite(
            1, tmp_path / "fp16", lambda shard: {**shard, "optimizer": {"loss_scaler": scaler}}
        )
    want, _, _ = import_megatron_v1(_fixture(1), vocab_size=128)
    got, _, _ = import_megatron_v1(root, vocab_size=128)
    assert all(torch.equal(got[n], t) for n, t in want.items())
    # Not a checkpoint at all.
    assert main(["--from-megatron-v1", str(tmp_path), "--save", str(tmp_path / "c")]) == 1
    assert "is it a v1.x checkpoint?" in capsys.readouterr().err


def test_a_numpy_module_named_by_the_file_is_never_imported(tmp_path, capsys):
    """The allowlist took any numpy.* module the pickle named and imported it: a file naming
    numpy.f2py.__main__ ran f2py's command line, and the import "succeeded" writing nothing.
    Only exact numpy globals are allowed now; the file is refused naming the global."""
    name = "numpy.f2py.__main__"
    fake = types.ModuleType(name)  # stands in while pickling, so the real one never loads

    def scalar():  # the name of one of numpy's reconstructors, in another module
        raise AssertionError("unreachable")

    scalar.__module__, scalar.__qualname__ = name, "scalar"
    fake.scalar = scalar

    class Crafted:
        def __reduce__(self):
            return (scalar, ())

    with mock.patch.dict(sys.modules, {name: fake}):
        root = _rewrite(1, tmp_path / "crafted", lambda shard: {**shard, "extra": Crafted()})
    assert name not in sys.modules
    with pytest.raises(CheckpointError, match=f"holds an object of {name}.scalar"):
        import_megatron_v1(root, vocab_size=128)
    assert name not in sys.modules, "the module the file names was imported"
    cli = _cli()(
        ["--from-megatron-v1", root, "--save", str(tmp_path / "out"), "--vocab-size", "128"]
    )
    assert cli == 1 and f"holds an object of {name}.scalar" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and name not in sys.modules


@pytest.mark.slow
def test_trainer_continues_from_an_imported_v115_checkpoint(tmp_path, data_prefix):
    out = str(tmp_path / "ours")
    assert _cli()(["--from-megatron-v1", _fixture(2), "--save", out, "--vocab-size", "128"]) == 0
    argv = [
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128"),
        *("--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2"),
        *("--global-batch-size", "4", "--train-iters", "9", "--lr", "1e-4"),
        *("--data-path", data_prefix, "--split", "90,10,0", "--eval-interval", "100"),
        *("--log-interval", "1", "--load", out, "--no-load-optim", "--no-load-rng"),
    ]
    ((history, _, iteration),) = run_distributed(_train, 1, argv)
    assert [h["iteration"] for h in history] == [8, 9] and iteration == 9
    assert all(np.isfinite([h["lm_loss"] for h in history]))
