"""The GPT on the shared trainer: its model provider, datasets and forward step.

Loss of one micro batch: the mean cross entropy of the next-token predictions over the tokens
the loss mask keeps (--eod-mask-loss drops the end-of-document ones).
"""

from __future__ import annotations

import functools

import torch

from megatron.config.schema import MegatronConfig
from megatron.data.builder import build_train_valid_test_datasets
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
        is_builder=rt.state.rank == 0,
        barrier=barrier,
    )


def forward_step(data_iterator, model):
    """One GPT micro batch: the chunk's output and the loss function for the last stage."""
    batch = get_batch(data_iterator, next(model.parameters()).device)
    output = model(  # per-token loss (b, s) on the last stage
        batch.tokens,
        position_ids=batch.position_ids,
        labels=batch.labels,
        document_ids=batch.document_ids,
    )
    return output, functools.partial(lm_loss, batch.loss_mask)


def lm_loss(loss_mask: torch.Tensor, per_token: torch.Tensor):
    """Mean language-model loss over the unmasked tokens of a micro batch."""
    loss = (per_token * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def make_forward_step(cfg: MegatronConfig):
    return forward_step
