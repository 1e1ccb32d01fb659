"""The ring under context parallelism (--context-parallel-size > 1) as an attention backend:
this rank's queries attend over the keys/values ringed round the CP group
(mpu/context_parallel.py). The K/V go round as `groups` heads (GQA); causal masks, and the
documents of packed samples by chunk (RING_DOCUMENTS), are what the ring takes of a mask."""

from __future__ import annotations

from megatron.model.attention.backends import AttentionBackend, register_backend


class RingBackend(AttentionBackend):
    name, grouped_kv = "ring", True

    def accepts(self, core, mask, q):
        return core.ring is not None  # the core builds one under context parallelism

    def attend(self, core, q, k, v, mask, p):
        documents = mask.type.ring_documents(mask)
        return core.ring(q, k, v, p, documents, scale=core.softmax_scale)


RING = register_backend(RingBackend(), priority=0)
