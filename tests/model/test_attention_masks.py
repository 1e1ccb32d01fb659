"""A mask kind and an attention backend registered from this file alone run through a small GPT.

The kind is a prefix-LM mask (every query sees its sample's prefix, and causally after it),
carrying the prefix lengths (b,); the model's logits under it equal a plain reference GPT's
attention with the same mask written out as booleans, through SDPA and the masked softmax, and
the causal default stays the reference's causal attention.
"""

import dataclasses

import pytest
import torch

from megatron.config.schema import ModelConfig
from megatron.fused_kernels import TORCH_OPS
from megatron.model.attention.backends import (
    AttentionBackend,
    choose_backend,
    register_backend,
    unregister_backend,
)
from megatron.model.attention.masks import (
    CAUSAL,
    MASK_KINDS,
    AttentionMask,
    MaskKind,
    causal_keep,
    register_mask_kind,
)
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.models import TINY
from tests.helpers.reference_gpt import RefGPT, load_from_megatron

DT = torch.float64


class PrefixLM(MaskKind):
    name, data = "prefix-lm", "prefix lengths"

    def keep(self, mask, s_q, s_k, device):
        prefix = mask.data.to(device).view(-1, 1, 1, 1)  # (b, 1, 1, 1)
        in_prefix = torch.arange(s_k, device=device).view(1, 1, 1, s_k) < prefix
        return causal_keep(s_q, s_k, device) | in_prefix  # (b, 1, s_q, s_k)


PREFIX_LM = register_mask_kind(PrefixLM())


class PlainSoftmax(AttentionBackend):
    """Runs prefix-LM masks only, by the textbook formula; counts its calls."""

    name = "plain softmax (test)"
    calls = 0

    def accepts(self, core, mask, q):
        return mask.type is PREFIX_LM and core.ring is None

    def attend(self, core, q, k, v, mask, p):
        PlainSoftmax.calls += 1
        scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5  # (b, heads, s_q, s_k)
        keep = mask.dense(q.size(2), k.size(2), q.device)
        return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


PLAIN = PlainSoftmax()

CFG = ModelConfig(**TINY, position_embedding_type="rope", num_query_groups=2)
PREFIX = torch.tensor([0, 3, 8])  # none, 3 tokens, half the sample's 16


def _explicit_keep(prefix: torch.Tensor, s: int) -> torch.Tensor:
    """(b, 1, s, s): j <= i, or j inside the sample's prefix."""
    i, j = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
    return ((j <= i) | (j < prefix.view(-1, 1, 1))).unsqueeze(1)


def _models(backend: str):
    ops = dataclasses.replace(TORCH_OPS, attention_backend=backend)
    model = GPTModel(CFG, BuildContext(seed=3, dtype=DT, ops=ops)).eval()
    ref = RefGPT(CFG).to(DT)
    load_from_megatron(ref, model)
    tokens = torch.randint(0, CFG.vocab_size, (3, CFG.seq_length), generator=torch.manual_seed(5))
    return model, ref, tokens


def test_the_kind_is_registered_and_checks_what_it_carries():
    assert MASK_KINDS["prefix-lm"] is PREFIX_LM
    with pytest.raises(ValueError, match="prefix-lm attention mask needs prefix lengths"):
        AttentionMask(PREFIX_LM)
    with pytest.raises(ValueError, match="registered already"):
        register_mask_kind(PrefixLM())


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_a_registered_mask_kind_runs_through_the_gpt(backend):
    model, ref, tokens = _models(backend)
    mask = AttentionMask(PREFIX_LM, data=PREFIX)
    keep = _explicit_keep(PREFIX, CFG.seq_length)
    with torch.no_grad():
        ours, expected = model(tokens, attention_mask=mask), ref(tokens, keep=keep)
        torch.testing.assert_close(ours[..., : CFG.vocab_size], expected, rtol=1e-9, atol=1e-9)
        causal = model(tokens)  # the default is unchanged: causal
        torch.testing.assert_close(causal[..., : CFG.vocab_size], ref(tokens), rtol=1e-9, atol=1e-9)
    assert torch.equal(ours[0], causal[0])  # an empty prefix is causal attention
    assert not torch.allclose(ours[1], causal[1])


def test_a_registered_backend_is_chosen_for_the_masks_it_accepts():
    model, ref, tokens = _models("sdpa")
    core = model.layers["0"].self_attention.core
    q = torch.zeros(1, 4, 2, 8, dtype=DT)
    register_backend(PLAIN, priority=50)
    try:
        mask = AttentionMask(PREFIX_LM, data=PREFIX)
        assert choose_backend(core, mask, q) is PLAIN
        assert choose_backend(core, CAUSAL, q).name == "sdpa"
        before = PlainSoftmax.calls
        with torch.no_grad():
            ours = model(tokens, attention_mask=mask)
        assert PlainSoftmax.calls - before == CFG.num_layers
        expected = ref(tokens, keep=_explicit_keep(PREFIX, CFG.seq_length))
        torch.testing.assert_close(ours[..., : CFG.vocab_size], expected, rtol=1e-9, atol=1e-9)
    finally:
        unregister_backend(PLAIN)
