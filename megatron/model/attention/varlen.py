"""Packed documents by cu_seqlens (THD): the VARLEN mask kind of --reset-attention-mask.

A packed micro batch (b, s) holds several documents per sample, and a token attends only to
earlier tokens of its own document. The batch carries one document id per token (b, s) (the
collate's, training/data.py); the model builds one VARLEN mask per forward from them, and
every layer's attention reads it. Flattened over the batch (T = b x s tokens, sample after
sample, the THD layout of the varlen kernels), the documents are the runs
[cu_seqlens[i], cu_seqlens[i + 1]), a sample's start always starting one; `max_seqlen` is the
longest run. Both are computed once, on first use, and cached in the mask (one host sync).

Which backend runs it: on CUDA a varlen kernel (varlen_cuda.py), else SDPA once per document
(varlen_sdpa.py): neither builds the (b, 1, s, s) mask. Every other backend (the masked
softmax of --attention-backend fused / unfused, SDPA under --torch-compile, whose graph cannot
loop over data-dependent documents) runs the kind's dense `keep`: block-diagonal causal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.model.attention.masks import (
    AttentionMask,
    MaskKind,
    document_attention_mask,
    register_mask_kind,
)


@dataclass(frozen=True, eq=False)
class VarlenDocuments:
    """The documents of a packed micro batch: `document_ids` (b, s), equal ids in contiguous
    runs within a sample (the collate's numbering; padding is a document of its own)."""

    document_ids: torch.Tensor  # (b, s)
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.document_ids.shape)

    def starts(self) -> torch.Tensor:
        """(b x s,) bool: True where a document starts, in the flattened batch."""
        ids = self.document_ids
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        return new.reshape(-1)

    @property
    def bounds(self) -> list[int]:
        """cu_seqlens as Python ints: 0, the start of each later document, b x s."""
        if "bounds" not in self._cache:
            ids = self.document_ids
            ordered = (ids[:, 1:] >= ids[:, :-1]).all().reshape(1).long()
            read = torch.cat([ordered, self.starts().nonzero().flatten()]).tolist()  # one sync
            if not read[0]:
                raise ValueError(
                    "document ids must not decrease along a sample (each document one run of "
                    "tokens, as the collate and the packer number them): a document id that "
                    "comes back later would be a new document to cu_seqlens. Fix: number the "
                    "documents of each sample in order (training/data.py document_fields)"
                )
            self._cache["bounds"] = [*read[1:], ids.numel()]
        return self._cache["bounds"]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """(documents + 1,) int32 on the ids' device: the varlen kernels' cu_seqlens."""
        if "cu" not in self._cache:
            cu = torch.tensor(self.bounds, dtype=torch.int32)
            self._cache["cu"] = cu.to(self.document_ids.device)
        return self._cache["cu"]

    @property
    def max_seqlen(self) -> int:
        """The longest document's length."""
        return max(self.lengths())

    def lengths(self) -> list[int]:
        """Every document's length, in order (sample after sample)."""
        b = self.bounds
        return [e - a for a, e in zip(b[:-1], b[1:], strict=False)]

    def cached(self, key, make):
        """What a backend builds once per mask (a block mask), kept with it."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


class _Varlen(MaskKind):
    name, data = "varlen", "varlen documents"

    def check(self, mask: AttentionMask) -> None:
        super().check(mask)
        if not isinstance(mask.data, VarlenDocuments):
            raise ValueError("a varlen attention mask carries VarlenDocuments")

    def keep(self, mask, s_q, s_k, device):
        s = mask.data.shape[1]
        if s_q != s or s_k != s:
            raise ValueError(
                f"a varlen mask covers {s} positions; {s_q} queries over {s_k} keys asked"
            )
        return document_attention_mask(mask.data.document_ids.to(device))


VARLEN = register_mask_kind(_Varlen())


def varlen_mask(document_ids: torch.Tensor) -> AttentionMask:
    """document_ids (b, s) -> causal attention within each token's own document, by cu_seqlens
    (nothing computed until a backend asks)."""
    return AttentionMask(VARLEN, data=VarlenDocuments(document_ids))


def flatten_heads(t: torch.Tensor) -> torch.Tensor:
    """(b, heads, s, d) -> (b x s, heads, d): the THD layout of the varlen kernels."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def unflatten_heads(t: torch.Tensor, b: int) -> torch.Tensor:
    """(b x s, heads, d) -> (b, heads, s, d)."""
    total, h, d = t.shape
    return t.view(b, total // b, h, d).transpose(1, 2)
