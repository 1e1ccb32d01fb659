"""Data for the trainer: train/valid/test datasets sized for the run, resumable loaders, batches.

Every rank of a TP group reads the same samples (same DP rank): the mmap reads are cheap, and
no broadcast is needed. Index files are built by global rank 0 while the others wait.
"""

from __future__ import annotations

import torch

from megatron.config.schema import MegatronConfig
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.initialize import Runtime, barrier


def split_sample_counts(cfg: MegatronConfig, dp_size: int) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's sizing)."""
    t = cfg.training
    gbs = t.resolved_global_batch_size(dp_size)
    train = t.train_samples if t.train_samples is not None else t.train_iters * gbs
    iters = t.train_iters if t.train_iters is not None else -(-train // gbs)
    valid = (iters // t.eval_interval + 1) * t.eval_iters * gbs
    return train, valid, t.eval_iters * gbs


def _loader(dataset, consumed: int, cfg: MegatronConfig, rt: Runtime):
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        len(dataset), consumed, cfg.training.micro_batch_size, rt.state.dp_rank, rt.state.dp_size
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.training.num_workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=cfg.training.num_workers > 0,
        # Its own generator: iter(loader) draws a worker base seed, and from the global torch
        # generator that would shift the dropout stream. A resume restores that generator from
        # the checkpoint *before* building the loaders (they need the consumed-sample count), so
        # the draw landed after the restore and dropout after a resume differed from straight
        # through. The base seed only seeds loader workers; the samples never depend on it.
        generator=torch.Generator().manual_seed(cfg.training.seed + rt.state.rank),
    )
    return iter(loader)


def build_data_iterators(
    cfg: MegatronConfig, rt: Runtime, consumed_train: int, consumed_valid: int
):
    counts = split_sample_counts(cfg, rt.state.dp_size)
    datasets = build_train_valid_test_datasets(
        cfg.data,
        counts,
        cfg.model.seq_length,
        cfg.training.seed,
        vocab_size=cfg.model.vocab_size,
        is_builder=rt.state.rank == 0,
        barrier=barrier,
    )
    train, valid, test = datasets
    if train is None:
        raise ValueError("no training data: pass --data-path (with --split) or --train-data-path")
    return (
        _loader(train, consumed_train, cfg, rt),
        _loader(valid, consumed_valid, cfg, rt),
        _loader(test, 0, cfg, rt),
    )


def get_batch(data_iterator, device: torch.device):
    """(tokens, labels, loss_mask) of the next micro batch: text[:, :-1] predicts text[:, 1:].

    The one batch fetch of both backends: the GPT's forward_step (training/step.py) and the
    DeepSpeed pipeline engine's PipeBatches (training/deepspeed/engine.py)."""
    text = next(data_iterator)["text"].to(device, non_blocking=True)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    return tokens, labels, torch.ones_like(labels, dtype=torch.float32)
