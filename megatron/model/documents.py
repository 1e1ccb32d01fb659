"""Attention within documents: the mask of --reset-attention-mask, built from document ids.

A packed sample holds several documents; with --reset-attention-mask a token may attend only to
earlier tokens of its own document. The batch carries one document id per token (b, s) rather
than Megatron's (b, 1, s, s) mask, so the pipeline sends and recompute keeps 1/s of the bytes;
each forward builds the boolean mask once from it and hands it to every layer.
"""

from __future__ import annotations

import torch


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """keep[b, 0, i, j] = (j <= i) and document_ids[b, i] == document_ids[b, j].

    document_ids: (b, s) -> (b, 1, s, s) bool, True where query i may see key j (broadcast over
    heads): causal attention restricted to the query's own document."""
    s = document_ids.size(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()  # (s, s)
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # (b, s, s)
    return (same & causal).unsqueeze(1)


def padding_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """keep[b, 0, i, j] = padding_mask[b, j] != 0: bidirectional attention (BERT) to every real
    key of the sample, whatever the query.

    padding_mask: (b, s), 1 for real tokens, 0 for padding -> (b, 1, s, s) bool (an expanded
    view, broadcast over heads). Giving ParallelAttention a mask tensor is what makes it
    non-causal: None means causal."""
    b, s = padding_mask.shape
    return (padding_mask != 0).view(b, 1, 1, s).expand(b, 1, s, s)
