"""Tiny GPT training runs on gloo ranks: the toy corpus, the flags, one run per rank, the
layouts-against-one-process workers that several test modules share."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.models.gpt.train import forward_step
from megatron.training.loop import pretrain
from megatron.training.train_loop import TrainResult

VOCAB = 128

# A model's shape and nothing else: for the flag-rule tests, which parse and never train.
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8"]
BASE += ["--seq-length", "32", "--vocab-size", "1000"]


def refusal(*flags: str, world_size: int = 2) -> str:
    """The ConfigError message parse_args raises for BASE + `flags` (it must raise one)."""
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *flags], world_size=world_size)
    return str(err.value)


def counting_corpus(directory, documents: int = 400, strided: bool = True) -> str:
    """An mmap corpus of counting sequences (random starts, and strides 1 to 3 if `strided`):
    learnable in a few steps. Returns its prefix."""
    prefix = f"{directory}/toy"
    rng = np.random.default_rng(0)
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(documents):
        if strided:
            start, stride, n = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(5, 60)
        else:
            (start, n), stride = (rng.integers(0, VOCAB), rng.integers(5, 60)), 1
        b.add_document([(start + stride * np.arange(n)) % VOCAB])
    b.finalize(f"{prefix}.idx")
    return prefix


def flags(data_prefix, *extra, iters=6):
    """A 2-layer, 32-wide GPT trained `iters` steps of 8 samples on `data_prefix`."""
    return [
        "--num-layers", "2",
        "--hidden-size", "32",
        "--num-attention-heads", "4",
        "--seq-length", "16",
        "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "8",
        "--hidden-dropout", "0",
        "--attention-dropout", "0",
        "--micro-batch-size", "2",
        "--global-batch-size", "8",
        "--train-iters", str(iters),
        "--lr-decay-iters", "12",
        "--lr", "3e-3",
        "--lr-warmup-iters", "2",
        "--data-path", data_prefix,
        "--split", "90,10,0",
        "--eval-interval", "100",
        "--eval-iters", "1",
        "--num-workers", "0",
        "--log-interval", "1",
        "--seed", "7",
        *extra,
    ]  # fmt: skip


def with_dropout(argv):
    """The same flags with --hidden-dropout and --attention-dropout 0.1 (both 0 in `flags`)."""
    out = list(argv)
    for name in ("--hidden-dropout", "--attention-dropout"):
        out[out.index(name) + 1] = "0.1"
    return out


def train_run(rank, world, argv, hook=None) -> TrainResult:
    """pretrain() on this rank with the GPT forward step (or `hook`, which wraps it); the whole
    result, the trained model (`.model`) included: for checks made inside the rank."""
    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    step = forward_step if hook is None else hook
    with open(os.devnull, "w") as out:
        return pretrain(cfg, forward_step_func=step, out=out)


def _train(rank, world, argv, hook=None):
    """train_run's (history, exit_reason, iteration): what a rank can send back to the test."""
    result = train_run(rank, world, argv, hook)
    return result.history, result.exit_reason, result.iteration


def train_quietly(rank, world, argv):
    """pretrain() with the family's own forward step and its output discarded; returns None."""
    cfg = parse_args(argv, world_size=world)
    validate(cfg, "train-gpt")
    with open(os.devnull, "w") as out:
        pretrain(cfg, out=out)


def _losses(history):
    return [h["lm_loss"] for h in history]


def assert_same_run(history, ref_history, what: str) -> None:
    """The logged losses and grad norms of two runs agree (float tolerance)."""
    np.testing.assert_allclose(_losses(history), _losses(ref_history), rtol=2e-5, err_msg=what)
    np.testing.assert_allclose(
        [h["grad_norm"] for h in history],
        [h["grad_norm"] for h in ref_history],
        rtol=1e-4,
        err_msg=what,
    )


_CALLS = {"n": 0}  # micro batches seen by a poisoning hook in this rank (reset before each run)


def _poison_third_micro_batch_on_rank1(data_iterator, model):
    """Rank 1's third micro batch returns an infinite (fp16) or NaN (fp32) loss."""
    output, loss_func = forward_step(data_iterator, model)
    _CALLS["n"] += 1
    if torch.distributed.get_rank() != 1 or _CALLS["n"] != 3:
        return output, loss_func
    bad = float("inf") if next(model.parameters()).dtype == torch.float16 else float("nan")

    def poisoned(out):
        loss = loss_func(out)[0] * bad
        return loss, {"lm loss": loss.detach()}

    return output, poisoned


def _sigterm_on_rank1_iteration3(data_iterator, model):
    _CALLS["n"] += 1
    if torch.distributed.get_rank() == 1 and _CALLS["n"] == 5:  # 2 micro batches per step
        os.kill(os.getpid(), signal.SIGTERM)
    return forward_step(data_iterator, model)


def _resume_worker(rank, world, argv, save_dir):
    """Straight 6 iterations vs 3 + save + resume + 3, without and with dropout (one spawn)."""
    runs = {}
    for kind, variant in (("no dropout", argv), ("dropout", with_dropout(argv))):
        d = f"{save_dir}/{kind.replace(' ', '_')}"
        straight = _train(rank, world, variant + ["--save", f"{d}/a", "--save-interval", "3"])
        first = _train(
            rank, world, [a if a != "6" else "3" for a in variant] + ["--save", f"{d}/b"]
        )
        second = _train(rank, world, variant + ["--load", f"{d}/b", "--save", f"{d}/b"])
        runs[kind] = (straight[0], first[0], second[0], second[2])
    return runs


def _ref_worker(rank, world, argv):
    """One run's history and final weights (the reference a parallel layout is held to)."""
    result = train_run(rank, world, argv)
    # numpy, not tensors: tensors would travel through shared memory the exiting rank frees
    weights = {k: v.numpy().copy() for k, v in result.model.state_dict().items()}
    return result.history, weights


def _shard_of(full, param, tp_rank, tp_size):
    if not mpu.is_tensor_parallel(param) or tp_size == 1:
        return full
    return mpu.shard(full, param.partition_dim, tp_rank, tp_size, param.partition_stride)


def _pp_worker(rank, world, argv, ref_weights, resume_dir=None):
    """A pipeline (x TP x DP) run whose final weights must be the reference's, with tied
    embeddings equal on the first and last stage; then, given `resume_dir`, _resume_worker."""
    result = train_run(rank, world, argv)
    model = result.model.module
    st = model.chunks[0].state
    for chunk in model.chunks:
        for name, p in chunk.named_parameters():
            full = torch.from_numpy(ref_weights[name])
            expected = _shard_of(full, p, st.tp_rank, st.tp_size)
            torch.testing.assert_close(
                p.detach(),
                expected,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m, n=name: f"final weight {n}: {m}",
            )
    tied = model.word_embeddings_weight()
    if st.embedding_group is not None and tied is not None:  # first and last stage's copies
        other = tied.detach().clone()
        dist.broadcast(other, st.embedding_ranks[0], group=st.embedding_group)
        assert torch.equal(other, tied.detach()), "tied embeddings drifted apart"
    out = {"history": result.history}
    if resume_dir is not None:
        out["resume"] = _resume_worker(rank, world, argv, resume_dir)
    return out
