"""BERT on the shared trainer: the model provider, the datasets and the forward step that
pretrain_bert.py hands to `training.loop.pretrain`.

Loss of one micro batch: MLM = mean over the chosen (masked) tokens of their cross entropy;
NSP = mean cross entropy of the binary head over the samples; the optimized loss is their sum,
and the log shows "lm loss" (MLM) and "nsp loss" apart.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn.functional as F

from megatron.config.schema import MegatronConfig
from megatron.config.schema_data import parse_blend, split_weights
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.builder import SPLIT_NAMES
from megatron.data.dataset_impl import make_indexed_dataset
from megatron.data.gpt_dataset import split_document_ranges
from megatron.data.tokenizers import build_tokenizer
from megatron.initialize import barrier
from megatron.models.bert.dataset import BertDataset, BertOptions, BertTokens
from megatron.models.bert.model import build_bert_model


def model_provider(cfg: MegatronConfig | None):
    """build(ModelConfig, BuildContext), for the backends (binary head from
    --bert-no-binary-head; cfg None: with the head)."""
    binary_head = cfg is None or not cfg.bert.bert_no_binary_head
    return functools.partial(build_bert_model, binary_head=binary_head)


def bert_tokens(cfg: MegatronConfig) -> BertTokens:
    """[CLS]/[SEP]/[MASK]/[PAD] ids (and '##' pieces) of the configured WordPiece vocab."""
    t = cfg.data.tokenizer
    tok = build_tokenizer(t.tokenizer_type, vocab_size=cfg.model.vocab_size, **t.kwargs())
    vocab = getattr(tok, "_tok", None)
    vocab = vocab.get_vocab(True) if vocab is not None else {}
    missing = [s for s in ("[CLS]", "[SEP]", "[MASK]", "[PAD]") if s not in vocab]
    if missing:
        raise ValueError(
            f"--vocab-file {t.vocab_file}: BERT needs the special tokens {missing}. Fix: pass a "
            "BERT vocab.txt with --tokenizer-type BertWordPieceLowerCase/BertWordPieceCase"
        )
    continuation = np.zeros(tok.vocab_size, dtype=bool)
    for piece, i in vocab.items():
        continuation[i] = piece.startswith("##")
    ids = [vocab[s] for s in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")]
    return BertTokens(*ids, vocab_size=tok.vocab_size, continuation=continuation)


def _splits(prefix, weights, counts, cfg, opts, tokens, is_builder):
    indexed = make_indexed_dataset(prefix, cfg.data.data_impl, cfg.data.mmap_warmup)
    ranges = split_document_ranges(indexed.num_documents, weights)
    return [
        BertDataset(
            name,
            indexed,
            r,
            n,
            cfg.training.seed,
            opts,
            tokens,
            cache_dir=cfg.data.data_cache_path,
            is_builder=is_builder,
            barrier=barrier,
        )
        if n > 0 and len(r)
        else None
        for name, r, n in zip(SPLIT_NAMES, ranges, counts, strict=True)
    ]


def datasets_provider(cfg: MegatronConfig, rt, counts):
    """[train, valid, test] BertDatasets: one prefix with --split, or a weighted blend."""
    if not cfg.data.data_path:
        raise ValueError("BERT takes --data-path PREFIX_text_sentence (with --split)")
    b = cfg.bert
    opts = BertOptions(
        cfg.model.seq_length,
        b.mask_prob,
        b.short_seq_prob,
        not b.bert_no_binary_head,
        b.whole_word_masking,
    )
    tokens, weights = bert_tokens(cfg), split_weights(cfg.data.split)
    blend, is_builder = parse_blend(cfg.data.data_path), rt.state.rank == 0
    if len(blend) == 1:
        return _splits(blend[0][1], weights, counts, cfg, opts, tokens, is_builder)
    parts = [
        _splits(p, weights, [int(n * w * 1.005) + 1 for n in counts], cfg, opts, tokens, is_builder)
        for w, p in blend
    ]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        members = [(w, p[s]) for (w, _), p in zip(blend, parts, strict=True) if p[s] is not None]
        if not members or counts[s] <= 0:
            out.append(None)
            continue
        prefix = os.path.abspath(members[0][1].indexed.prefix)
        cache = cfg.data.data_cache_path or os.path.join(os.path.dirname(prefix), "index-cache")
        out.append(
            BlendableDataset(
                [d for _, d in members],
                [w for w, _ in members],
                counts[s],
                name=f"bert-{name}",
                cache_dir=cache,
                is_builder=is_builder,
                barrier=barrier,
                description={"parts": [p for _, p in blend], "seed": cfg.training.seed},
            )
        )
    return out


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def forward_step(data_iterator, model):
    """One BERT micro batch: the chunk's output and the loss function for the last stage."""
    data = next(data_iterator)
    device = _device_of(model)
    tokens, types, pad, labels = (
        data[k].to(device, non_blocking=True) for k in ("text", "types", "padding_mask", "labels")
    )
    output = model(tokens, pad, types, labels)
    loss_mask = data["loss_mask"].to(device, non_blocking=True)
    return output, functools.partial(bert_loss, loss_mask, data["is_random"].to(device))


def bert_loss(loss_mask: torch.Tensor, is_random: torch.Tensor, output):
    """(MLM + NSP, stats). output: (per-token MLM loss (b, s), NSP logits (b, 2) or None)."""
    per_token, nsp_logits = output
    lm = (per_token.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    if nsp_logits is None:
        return lm, {"lm loss": lm.detach()}
    nsp = F.cross_entropy(nsp_logits.float(), is_random)
    return lm + nsp, {"lm loss": lm.detach(), "nsp loss": nsp.detach()}


def make_forward_step(cfg: MegatronConfig):
    """forward_step, telling the trainer which stats besides "lm loss" to average and log."""

    def step(data_iterator, model):
        return forward_step(data_iterator, model)

    step.other_losses = () if cfg.bert.bert_no_binary_head else ("nsp loss",)
    return step
