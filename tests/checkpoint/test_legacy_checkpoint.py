"""A checkpoint written by main before the package layout and config changes (commit 19d2b2d,
tests/fixtures/legacy_checkpoint) still loads, resumes where it stopped and converts."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from megatron.checkpoint.resharding import load_full_state, model_config
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.checkpoints import _cli as _convert_cli
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import FIXTURES

FIXTURE = FIXTURES / "legacy_checkpoint"
VOCAB = 128


def _toy_corpus(prefix: str) -> None:
    """The corpus the fixture was trained on (make_fixture.py, same seed and order of draws)."""
    rng = np.random.default_rng(0)
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(400):
        start, stride, n = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(5, 60)
        builder.add_document([(start + stride * np.arange(n)) % VOCAB])
    builder.finalize(f"{prefix}.idx")


def _flags(tmp_path, *extra) -> list[str]:
    """make_fixture.py's flags: a 2-layer, hidden-16 GPT trained for 6 iterations."""
    return [
        *f"--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 16 "
        f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 8 --hidden-dropout 0 "
        "--attention-dropout 0 --micro-batch-size 2 --global-batch-size 4 --train-iters 6 "
        "--lr-decay-iters 12 --lr 3e-3 --lr-warmup-iters 2 --split 90,10,0 --eval-interval 100 "
        "--eval-iters 1 --num-workers 0 --log-interval 1 --seed 7".split(),
        "--data-path",
        str(tmp_path / "toy"),
        "--data-cache-path",
        str(tmp_path / "cache"),
        *extra,
    ]


def _train(rank, world, argv):
    from megatron.config.cli import parse_args
    from megatron.config.rules import validate
    from megatron.training.loop import pretrain

    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    result = pretrain(cfg, out=open(os.devnull, "w"))
    return [h["lm_loss"] for h in result.history], result.iteration


@pytest.fixture
def legacy(tmp_path):
    """A writable copy of the fixture (a run appends to it) and its corpus."""
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    _toy_corpus(str(tmp_path / "toy"))
    return tmp_path


def test_legacy_checkpoint_resumes_with_the_losses_of_the_old_uninterrupted_run(legacy):
    straight = json.load(open(os.path.join(FIXTURE, "losses.json")))["straight_losses"]
    ((losses, iteration),) = run_distributed(
        _train, 1, _flags(legacy, "--load", str(legacy / "ckpt"))
    )
    assert iteration == 6 and len(losses) == 3
    # Optimizer moments, LR step and data position all come from the checkpoint: a resume that
    # dropped any of them would move these losses by far more than float rounding.
    np.testing.assert_allclose(losses, straight[3:], rtol=1e-5)


@torch.no_grad()
def _logits(state: dict, args: dict, tokens: torch.Tensor) -> torch.Tensor:
    cfg = model_config(args)
    model = GPTModel(cfg, BuildContext(seed=0, dtype=torch.float32)).eval()
    padded = cfg.padded_vocab_size(1)
    for name, tensor in state.items():  # full states hold exactly vocab_size rows
        if tensor.shape[0] == cfg.vocab_size and padded != cfg.vocab_size:
            state[name] = torch.cat(
                [tensor, tensor.new_zeros(padded - cfg.vocab_size, *tensor.shape[1:])]
            )
    model.load_state_dict(state)
    return model(tokens)[..., : cfg.vocab_size]


def test_legacy_checkpoint_reshards_to_tp2_and_exports_to_hugging_face(legacy):
    src, tp2, hf = str(legacy / "ckpt"), str(legacy / "tp2"), str(legacy / "hf")
    main = _convert_cli()
    assert main(["--load", src, "--save", tp2, "--target-tensor-model-parallel-size", "2"]) == 0
    state, args = load_full_state(src)
    state2, args2 = load_full_state(tp2)
    assert args2["tensor_model_parallel_size"] == 2
    assert state.keys() == state2.keys()
    for name in state:
        torch.testing.assert_close(state2[name], state[name], rtol=0, atol=0, msg=name)

    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ours = _logits(state, args, tokens)
    transformers = pytest.importorskip("transformers", reason="HF export checks need transformers")
    assert main(["--load", src, "--to-hf", hf]) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(hf, local_files_only=True).eval()
    with torch.no_grad():
        theirs = model(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
