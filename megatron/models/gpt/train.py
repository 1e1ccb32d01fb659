"""The GPT on the shared trainer: its model provider, datasets and forward step.

Loss of one micro batch: the mean cross entropy of the next-token predictions over the tokens
the loss mask keeps (--eod-mask-loss drops the end-of-document ones).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron.config.schema import MegatronConfig
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.dataset_pair import tokenizer_fingerprint
from megatron.data.tokenizers import build_tokenizer
from megatron.initialize import Runtime, barrier
from megatron.models.gpt.model import build_model
from megatron.training.data import get_batch


def model_provider(cfg: MegatronConfig | None):
    """build(ModelConfig, BuildContext) -> ModelChunks: the GPT needs nothing else."""
    return build_model


def datasets_provider(cfg: MegatronConfig, rt: Runtime, counts):
    """[train, valid, test] GPT datasets: --data-path (with --split), the per-split paths, or a
    blend, each sample seq_length + 1 tokens."""
    return build_train_valid_test_datasets(
        cfg.data,
        counts,
        cfg.model.seq_length,
        cfg.training.seed,
        vocab_size=cfg.model.vocab_size,
        tokenizer=run_tokenizer_fingerprint(cfg),
        is_builder=rt.state.rank == 0,
        barrier=barrier,
    )


def run_tokenizer_fingerprint(cfg: MegatronConfig) -> dict | None:
    """The fingerprint of this run's tokenizer, checked against the one the data records
    (None without --tokenizer-type: the data is read as ids)."""
    tok = cfg.data.tokenizer
    if tok.tokenizer_type is None:
        return None
    # vocab_size only matters to NullTokenizer, which has no fingerprint to compare
    built = build_tokenizer(tok.tokenizer_type, vocab_size=cfg.model.vocab_size, **tok.kwargs())
    return tokenizer_fingerprint(built)


def forward_step(data_iterator, model):
    """One GPT micro batch: the chunk's output and the loss function for the last stage."""
    state = _state_of(model)  # with context parallelism: this CP rank's chunks
    batch = get_batch(data_iterator, next(model.parameters()).device, state)
    return _forward(batch, model, state)


def packed_forward_step(seq_length: int, data_iterator, model):
    """forward_step under --sequence-packing first-fit, with the share of the micro batch's
    tokens that are tail padding (their document id is `seq_length`, data/packing.py), logged
    beside the loss as "padding fraction"."""
    state = _state_of(model)
    batch = get_batch(data_iterator, next(model.parameters()).device, state)
    output, loss_fn = _forward(batch, model, state)
    padding = (batch.document_ids == seq_length).float().mean()

    def with_padding(per_token):
        loss, stats = loss_fn(per_token)
        return loss, {**stats, "padding fraction": padding}

    return output, with_padding


def _forward(batch, model, state):
    output = model(  # per-token loss (b, s) on the last stage
        batch.tokens,
        position_ids=batch.position_ids,
        labels=batch.labels,
        document_ids=batch.document_ids,
        loss_mask=batch.loss_mask,  # multi-token prediction rolls it with the labels
    )
    cp = state if state is not None and state.cp_size > 1 else None
    return output, functools.partial(lm_loss, batch.loss_mask, context_parallel=cp)


def lm_loss(loss_mask: torch.Tensor, per_token: torch.Tensor, context_parallel=None):
    """Mean language-model loss over the unmasked tokens of a micro batch.

    `context_parallel` (a ParallelState with CP > 1): this rank holds 2 of the 2 x CP chunks
    of each sample; the mean is over all the tokens of the samples (sums and counts
    all-reduced over CP). The loss to backpropagate is this rank's share of it times CP, as
    the gradients are averaged over DP x CP: the CP shares then add up to the whole mean's."""
    local, count = (per_token * loss_mask).sum(), loss_mask.sum()
    if context_parallel is None:
        loss = local / count
        return loss, {"lm loss": loss.detach()}
    totals = torch.stack([local.detach().float(), count.float()])
    dist.all_reduce(totals, group=context_parallel.cp_group)
    loss = local * context_parallel.cp_size / totals[1]
    return loss, {"lm loss": totals[0] / totals[1]}


def _state_of(model):
    """The chunk's ParallelState (through torch DDP's wrapper with --DDP-impl torch)."""
    return getattr(model, "state", None) or getattr(getattr(model, "module", None), "state", None)


def make_forward_step(cfg: MegatronConfig):
    if cfg.data.sequence_packing == "first-fit":
        step = functools.partial(packed_forward_step, cfg.model.seq_length)
        step.other_losses = ("padding fraction",)
        return step
    return forward_step
