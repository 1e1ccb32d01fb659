"""Data for the trainer: train/valid/test datasets sized for the run, resumable loaders, batches.

Every rank of a TP group reads the same samples (same DP rank): the mmap reads are cheap, and
no broadcast is needed. Index files are built by global rank 0 while the others wait.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.config.schema import MegatronConfig
from megatron.config.schema_data import DataConfig
from megatron.data.loose_json import CorpusError, prepare_loose_json
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.initialize import Runtime
from megatron.mpu.context_parallel import context_parallel_slice
from megatron.mpu.parallel_state import ParallelState
from megatron.resilience.fault_tolerance import batch_share


def split_sample_counts(cfg: MegatronConfig, dp_size: int) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's sizing)."""
    t = cfg.training
    gbs = t.resolved_global_batch_size(dp_size)
    train = t.train_samples if t.train_samples is not None else t.train_iters * gbs
    iters = t.train_iters if t.train_iters is not None else -(-train // gbs)
    valid = (iters // t.eval_interval + 1) * t.eval_iters * gbs
    return train, valid, t.eval_iters * gbs


@dataclass(frozen=True)
class DocumentMasking:
    """Megatron's document-boundary options over packed samples (--reset-position-ids,
    --reset-attention-mask, --eod-mask-loss) and the end-of-document id `eod` they key on."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def from_config(cls, data: DataConfig, eod: int | None) -> DocumentMasking | None:
        """None when no option is on (the batches are then exactly as without them)."""
        if not data.uses_documents:
            return None
        if eod is None:
            raise ValueError(
                "--reset-position-ids/--reset-attention-mask/--eod-mask-loss need the "
                "end-of-document id. Fix: pass --tokenizer-type"
            )
        return cls(eod, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss)

    @property
    def model_inputs(self) -> bool:
        """The options that change what the model sees (not only the loss)."""
        return self.reset_position_ids or self.reset_attention_mask


def document_fields(tokens: torch.Tensor, documents: DocumentMasking) -> dict[str, torch.Tensor]:
    """The per-token fields the options ask for, from the input tokens (b, s).

    An end-of-document (EOD) token belongs to the document it ends; the next token starts a new
    one. document_ids[b, t] = number of EODs in tokens[b, :t] (the model keeps attention within
    equal ids); position_ids[b, t] = t - (start of t's document); loss_mask is 0 where the input
    is an EOD (its label is the next document's first token). Megatron's
    get_ltor_masks_and_position_ids, vectorized, with ids instead of an (s, s) mask.
    """
    eod = tokens == documents.eod  # (b, s)
    fields = {}
    if documents.eod_mask_loss:
        fields["loss_mask"] = (~eod).to(torch.float32)
    if documents.reset_attention_mask:
        fields["document_ids"] = eod.long().cumsum(1) - eod.long()
    if documents.reset_position_ids:
        t = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)  # (b, s)
        after_eod = torch.where(eod, t + 1, 0)  # where a new document would start
        # start[t] = max(after_eod[:t]): the first position of t's document
        start = F.pad(after_eod.cummax(1).values[:, :-1], (1, 0))
        fields["position_ids"] = t - start
    return fields


def collate(documents: DocumentMasking | None, samples: list[dict]) -> dict[str, torch.Tensor]:
    """The default collate, plus the document fields of the input tokens text[:, :-1] (in the
    loader's workers, off the training loop)."""
    batch = torch.utils.data.default_collate(samples)
    if documents is not None:  # packed samples (data/packing.py) bring their own fields
        for name, value in document_fields(batch["text"][:, :-1], documents).items():
            own = batch.get(name)
            if own is None:
                batch[name] = value
            elif name == "loss_mask":  # --eod-mask-loss on top of the packing's own mask
                batch[name] = own * value
    return batch


def _worker_ignores_sigterm(worker_id: int) -> None:
    """A launcher's SIGTERM goes to the whole process group (torchrun kills with killpg), so it
    reaches the loader workers too. With --exit-signal-handler the rank's main process owns it:
    a worker killed by it would make the main process raise "DataLoader worker ... is killed
    by signal" (from its SIGCHLD handler, even inside torch.save) instead of saving. The
    workers still stop with their rank: at its exit, or by their watchdog when it dies."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class SeekableIterator:
    """--fault-tolerance's train iterator: seek(consumed) starts over at a sample position (a
    step the replica groups dropped is redone on its samples; a replacement takes a peer's)."""

    def __init__(self, make, consumed: int):
        self.make, self.it = make, make(consumed)

    def seek(self, consumed: int) -> None:
        self.it = self.make(consumed)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)


def _loader(dataset, consumed: int, cfg: MegatronConfig, rt: Runtime, documents=None):
    if dataset is None:
        return None
    if cfg.parallel.fault_tolerance:
        make = functools.partial(_plain_loader, dataset, cfg=cfg, rt=rt, documents=documents)
        return SeekableIterator(make, consumed)
    return _plain_loader(dataset, consumed, cfg, rt, documents)


def _plain_loader(dataset, consumed: int, cfg: MegatronConfig, rt: Runtime, documents=None):
    dp_rank, dp_size = batch_share(cfg, rt.state)  # --fault-tolerance: the replica group's
    sampler = MegatronPretrainingSampler(
        len(dataset), consumed, cfg.training.micro_batch_size, dp_rank, dp_size
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.training.num_workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=cfg.training.num_workers > 0,
        worker_init_fn=_worker_ignores_sigterm if cfg.training.exit_signal_handler else None,
        collate_fn=functools.partial(collate, documents) if documents is not None else None,
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
    cfg: MegatronConfig,
    rt: Runtime,
    consumed_train: int,
    consumed_valid: int,
    documents: DocumentMasking | None,
    datasets_provider,
):
    """Train / valid / test iterators over the datasets `datasets_provider(cfg, rt, counts)`
    (the model family's) builds; with `documents`, the language-model batches ("text"
    (b, s + 1)) get the fields of document_fields."""
    counts = split_sample_counts(cfg, batch_share(cfg, rt.state)[1])
    if cfg.data.loose_json.given:
        cfg = dataclasses.replace(cfg, data=resolve_data_config(cfg, rt.state.rank))
    train, valid, test = datasets_provider(cfg, rt, counts)
    if train is None:
        raise ValueError(
            "no training data: pass --data-path (with --split), --train-data-path, or "
            "--train-data (loose JSON)"
        )
    return (
        _loader(train, consumed_train, cfg, rt, documents),
        _loader(valid, consumed_valid, cfg, rt, documents),
        _loader(test, 0, cfg, rt, documents),
    )


def validation_off(cfg: MegatronConfig, valid_iter) -> str | None:
    """Why validation cannot run although --eval-iters asks for it (None when it runs or is not
    asked for). Megatron-LM skips it silently then (do_valid is false); we say so at start."""
    eval_iters = cfg.training.eval_iters
    if valid_iter is not None or not eval_iters:
        return None
    d = cfg.data
    if d.data_path or (d.loose_json.train_data and not d.loose_json.valid_data):
        why = f"--split {d.split} leaves the validation split no documents"
        fix = "give validation a share of --split (e.g. 969,30,1)"
    else:
        why = "no validation data is given (--valid-data-path or --valid-data)"
        fix = "pass --valid-data-path"
    return (
        f"validation is off: {why}, so --eval-iters {eval_iters} has nothing to read and no "
        f"validation loss will be logged. Fix: {fix}, or pass --eval-iters 0 to turn it off"
    )


class Batch(NamedTuple):
    """One micro batch. position_ids / document_ids (b, s) are None unless
    --reset-position-ids / --reset-attention-mask ask for them (the model then uses 0..s-1 and
    plain causal attention)."""

    tokens: torch.Tensor  # (b, s)
    labels: torch.Tensor  # (b, s)
    loss_mask: torch.Tensor  # (b, s) float32
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None


def get_batch(data_iterator, device: torch.device, state: ParallelState | None = None) -> Batch:
    """The next micro batch: text[:, :-1] predicts text[:, 1:], with the loss mask and the
    document fields the loader added (see collate). With context parallelism (`state.cp_size`
    > 1) every field is this CP rank's load-balanced chunks (b, s / CP), position ids included
    (the chunks' places in the whole sequence).

    The one batch fetch of both backends: a language model's forward_step
    (megatron/models/gpt/train.py) and the DeepSpeed pipeline engine's PipeBatches
    (training/deepspeed/engine.py)."""
    data = next(data_iterator)
    text = data["text"].to(device, non_blocking=True)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    optional = (data.get(k) for k in ("loss_mask", "position_ids", "document_ids"))
    loss_mask, position_ids, document_ids = (
        None if t is None else t.to(device, non_blocking=True) for t in optional
    )
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    batch = Batch(tokens, labels, loss_mask, position_ids, document_ids)
    if state is not None and state.cp_size > 1:
        return _context_parallel_batch(batch, state)
    return batch


def _context_parallel_batch(batch: Batch, state: ParallelState) -> Batch:
    """This CP rank's chunks r and 2 CP - 1 - r of every field (mpu/context_parallel.py)."""
    b, s = batch.tokens.shape
    positions = batch.position_ids
    if positions is None:  # the global positions of this rank's chunks, not 0..s/CP-1
        positions = torch.arange(s, device=batch.tokens.device).expand(b, s)
    cut = functools.partial(context_parallel_slice, cp_rank=state.cp_rank, cp_size=state.cp_size)
    documents = None if batch.document_ids is None else cut(batch.document_ids)
    fields = (batch.tokens, batch.labels, batch.loss_mask, positions)
    return Batch(*(cut(t) for t in fields), documents)
