"""Which keys each query of an attention layer may see, as an explicit type.

    CAUSAL     query i sees keys <= i; when there are fewer queries than keys (generation with
               a KV cache) the queries are the last positions, so the last query sees every key
    PADDING    bidirectional, every real (non-padding) key of the sample: BERT
    ARBITRARY  a given keep-mask (b, 1, s_q, s_k): the documents of a packed sample
               (--reset-attention-mask), or a KV-cache prefix
    RING_DOCUMENTS  the documents of a packed sample under context parallelism: the whole
               sequences' document ids by chunk (mpu/ring_documents.py), from which ring
               attention builds each block's mask; no (s, s) tensor

PADDING and ARBITRARY masks carry the boolean tensor (True where query i may see key j,
broadcast over heads); the causal mask needs none.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from megatron.model.documents import document_attention_mask, padding_attention_mask
from megatron.mpu.ring_documents import RingDocuments


class MaskType(enum.Enum):
    CAUSAL = "causal"
    PADDING = "padding"
    ARBITRARY = "arbitrary"
    RING_DOCUMENTS = "ring documents"


@dataclass(frozen=True)
class AttentionMask:
    type: MaskType
    keep: torch.Tensor | None = None  # (b, 1, s_q, s_k) bool; for PADDING and ARBITRARY
    ring: RingDocuments | None = None  # for RING_DOCUMENTS

    def __post_init__(self):
        tensor = self.type in (MaskType.PADDING, MaskType.ARBITRARY)
        if tensor != (self.keep is not None):
            wants = "needs a" if tensor else "takes no"
            raise ValueError(f"a {self.type.value} attention mask {wants} keep tensor")
        if (self.type is MaskType.RING_DOCUMENTS) != (self.ring is not None):
            wants = "needs" if self.type is MaskType.RING_DOCUMENTS else "takes no"
            raise ValueError(f"a {self.type.value} attention mask {wants} ring documents")

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
        return AttentionMask(MaskType.RING_DOCUMENTS, ring=documents)

    @staticmethod
    def arbitrary(keep: torch.Tensor) -> AttentionMask:
        return AttentionMask(MaskType.ARBITRARY, keep)


CAUSAL = AttentionMask(MaskType.CAUSAL)
