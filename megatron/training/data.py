"""Data for the trainer: train/valid/test datasets sized for the run, resumable loaders, batches.

Every rank of a TP group reads the same samples (same DP rank): the mmap reads are cheap, and
no broadcast is needed. Index files are built by global rank 0 while the others wait.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.config.schema import MegatronConfig
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.loose_json import CorpusError, prepare_loose_json
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


def _share_from_rank0(wait_minutes: float):
    """share(status) for prepare_loose_json: rank 0's status dict reaches every rank, over a
    gloo group of its own whose timeout is --cache-wait-minutes (tokenizing a large corpus
    may take longer than --distributed-timeout-minutes allows a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda status: status

    # Made by every rank now, before rank 0 starts tokenizing.
    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=wait_minutes))

    def share(status):
        box = [status]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except RuntimeError as e:
            raise CorpusError(
                f"rank {dist.get_rank()} waited {wait_minutes} min for rank 0 to tokenize the "
                "--train-data/--valid-data/--test-data corpora into --cache-dir and gave up "
                f"({e}). Fix: raise --cache-wait-minutes (rank 0's log says whether it is "
                "still tokenizing)"
            ) from None
        finally:
            dist.destroy_process_group(group)
        return box[0]

    return share


def resolve_data_config(cfg: MegatronConfig, rank: int):
    """cfg.data, with loose JSON corpora (--train-data & co.) replaced by their cached mmap
    prefixes; rank 0 tokenizes them once while the other ranks wait."""
    data = cfg.data
    return prepare_loose_json(
        data,
        cfg.model.vocab_size,
        is_builder=rank == 0,
        share=_share_from_rank0(data.loose_json.cache_wait_minutes),
        log=lambda msg: print(msg, flush=True) if rank == 0 else None,
    )


def build_data_iterators(
    cfg: MegatronConfig, rt: Runtime, consumed_train: int, consumed_valid: int
):
    counts = split_sample_counts(cfg, rt.state.dp_size)
    if cfg.data.loose_json.given:
        cfg = dataclasses.replace(cfg, data=resolve_data_config(cfg, rt.state.rank))
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
        raise ValueError(
            "no training data: pass --data-path (with --split), --train-data-path, or "
            "--train-data (loose JSON)"
        )
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
