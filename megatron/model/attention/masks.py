"""Which keys each query of an attention layer may see, as data: an AttentionMask is a kind and
what that kind carries; the backends (backends.py) ask the kind, never branch on its name.

    CAUSAL     query i sees keys <= i; when there are fewer queries than keys (generation with
               a KV cache) the queries are the last positions, so the last query sees every key
    PADDING    bidirectional, every real (non-padding) key of the sample: BERT
    ARBITRARY  a given keep-mask (b, 1, s_q, s_k): a KV-cache prefix, or documents given as
               a dense mask (--reset-attention-mask takes VARLEN, varlen.py: cu_seqlens)
    RING_DOCUMENTS  the documents of a packed sample under context parallelism: the whole
               sequences' document ids by chunk (mpu/ring_documents.py), from which ring
               attention builds each block's mask; no (s, s) tensor

PADDING and ARBITRARY masks carry the boolean tensor (True where query i may see key j,
broadcast over heads); the causal mask carries nothing. A new kind (a sliding window, a
prefix-LM mask, packed documents by cu_seqlens) is a MaskKind subclass in one file, passed to
`register_mask_kind`: it says what it carries (`check`), its dense boolean form (`keep`, which
every backend can run) and what ring attention takes of it (`ring_documents`); a backend with
a faster path for it (a window size for a varlen kernel) reads the kind's own fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.mpu.ring_documents import RingDocuments


class MaskKind:
    """One kind of attention mask. `carries_keep`: its masks carry a keep tensor; `data`: the
    name of what else they carry (None: nothing); `causal`: it is the causal mask, which the
    backends run without a tensor (SDPA's is_causal, the causal softmax kernel)."""

    name: str = ""
    carries_keep: bool = False
    data: str | None = None
    causal: bool = False

    def check(self, mask: AttentionMask) -> None:
        """Raise ValueError where `mask` does not carry what this kind needs."""
        if self.carries_keep != (mask.keep is not None):
            wants = "needs a" if self.carries_keep else "takes no"
            raise ValueError(f"a {self.name} attention mask {wants} keep tensor")
        if (self.data is not None) != (mask.data is not None):
            wants = f"needs {self.data}" if self.data else "takes no data"
            raise ValueError(f"a {self.name} attention mask {wants}")

    def keep(self, mask: AttentionMask, s_q: int, s_k: int, device) -> torch.Tensor:
        """(b or 1, 1, s_q, s_k) bool, True where a query (the last s_q of the s_k positions)
        may see a key."""
        return mask.keep

    def ring_documents(self, mask: AttentionMask) -> RingDocuments | None:
        """What ring attention takes of `mask`: its documents, or None (causal)."""
        raise ValueError(
            f"ring attention (--context-parallel-size > 1) takes causal or document masks, not "
            f"a {self.name} mask"
        )

    def __repr__(self) -> str:
        return f"<mask kind {self.name}>"


MASK_KINDS: dict[str, MaskKind] = {}


def register_mask_kind(kind: MaskKind) -> MaskKind:
    """Add `kind` to the kinds the model knows by name; returns it."""
    if not kind.name or kind.name in MASK_KINDS:
        raise ValueError(f"attention mask kind {kind.name!r} is unnamed or registered already")
    MASK_KINDS[kind.name] = kind
    return kind


def causal_keep(s_q: int, s_k: int, device) -> torch.Tensor:
    """(1, 1, s_q, s_k) bool: query i (at position s_k - s_q + i) sees keys <= its position."""
    q = torch.arange(s_k - s_q, s_k, device=device).unsqueeze(1)
    return (torch.arange(s_k, device=device).unsqueeze(0) <= q).view(1, 1, s_q, s_k)


class _Causal(MaskKind):
    name, causal = "causal", True

    def keep(self, mask, s_q, s_k, device):
        return causal_keep(s_q, s_k, device)

    def ring_documents(self, mask):
        return None


class _Padding(MaskKind):
    name, carries_keep = "padding", True


class _Arbitrary(MaskKind):
    name, carries_keep = "arbitrary", True


class _RingDocuments(MaskKind):
    name, data = "ring documents", "ring documents"

    def keep(self, mask, s_q, s_k, device):
        raise ValueError("a ring-documents mask needs --context-parallel-size > 1")

    def ring_documents(self, mask):
        return mask.data


class MaskType:
    """The built-in kinds (registered)."""

    CAUSAL = register_mask_kind(_Causal())
    PADDING = register_mask_kind(_Padding())
    ARBITRARY = register_mask_kind(_Arbitrary())
    RING_DOCUMENTS = register_mask_kind(_RingDocuments())


@dataclass(frozen=True)
class AttentionMask:
    type: MaskKind
    keep: torch.Tensor | None = None  # (b, 1, s_q, s_k) bool; for PADDING and ARBITRARY
    data: Any = None  # what else the kind carries (RING_DOCUMENTS: RingDocuments)

    def __post_init__(self):
        self.type.check(self)

    @staticmethod
    def causal() -> AttentionMask:
        return CAUSAL

    @staticmethod
    def padding(padding_mask: torch.Tensor) -> AttentionMask:
        """padding_mask (b, s): 1 for real tokens, 0 for padding."""
        return AttentionMask(MaskType.PADDING, padding_attention_mask(padding_mask))

    @staticmethod
    def documents(document_ids: torch.Tensor) -> AttentionMask:
        """document_ids (b, s): causal attention within each token's own document."""
        return AttentionMask(MaskType.ARBITRARY, document_attention_mask(document_ids))

    @staticmethod
    def ring_documents(documents: RingDocuments) -> AttentionMask:
        """Causal attention within documents under context parallelism (ring attention)."""
        return AttentionMask(MaskType.RING_DOCUMENTS, data=documents)

    @staticmethod
    def arbitrary(keep: torch.Tensor) -> AttentionMask:
        return AttentionMask(MaskType.ARBITRARY, keep)

    def dense(self, s_q: int, s_k: int, device) -> torch.Tensor:
        """The boolean keep-mask of queries at the last s_q of s_k positions (any kind)."""
        return self.type.keep(self, s_q, s_k, device)


CAUSAL = AttentionMask(MaskType.CAUSAL)


# --reset-attention-mask: a packed sample holds several documents and a token attends only to
# earlier tokens of its own document. The batch carries one document id per token (b, s)
# rather than Megatron's (b, 1, s, s) mask, so the pipeline sends and recompute keeps 1/s of
# the bytes; each forward builds the boolean mask once from it and hands it to every layer.


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
    view, broadcast over heads)."""
    b, s = padding_mask.shape
    return (padding_mask != 0).view(b, 1, 1, s).expand(b, 1, s, s)
