"""BertModel: the GPT's transformer layers run bidirectionally, with BERT's embeddings and heads.

An ordered layer list like GPTModel's (embedding, N transformer layers, head), so one process,
native pipeline stages and TP all run it, with the same per-name seeded init: one seed gives one
model at any TP / PP size. Attention sees every non-padding key of its sample (a PADDING mask,
model/attention/masks.py), never the causal mask. Built from (ModelConfig, BuildContext) and the
binary head switch; recompute and compile are applied afterwards (megatron.model.parallelize).

Layer order: with --apply-residual-connection-post-layernorm each layer is
n1 = norm(x); h = n1 + attn(n1); n2 = norm(h); out = n2 + mlp(n2), and a final norm follows, which
is exactly the original (post-LN) BERT once the norms are renamed: layer 0's input norm is BERT's
embedding LayerNorm, layer l's post-attention norm its attention-output LayerNorm, and layer
l + 1's input norm (the final norm for the last layer) its output LayerNorm
(models/bert/hf.py maps them). Without the flag the layers are pre-LN.

Heads on the last stage: final norm -> MLM head dense + GeLU + norm -> logits against the tied
word embedding + a vocab-parallel bias; pooler tanh(dense(h[:, 0])) -> binary (NSP) head, unless
--bert-no-binary-head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.layer_pattern import layer_kinds
from megatron.config.schema import ModelConfig
from megatron.model.attention.masks import AttentionMask
from megatron.model.context import BuildContext, chunk_embedding, start_chunk
from megatron.model.layer_kinds import build_layer
from megatron.model.norms import build_norm
from megatron.model.recompute import run_layers
from megatron.model.stages import ModelChunks, stage_layer_range
from megatron.model.weights import init_weights
from megatron.mpu.layers import VocabParallelEmbedding, set_tensor_model_parallel_attributes
from megatron.mpu.mappings import copy_to_tensor_model_parallel_region

NUM_TOKENTYPES = 2  # segment A / segment B


class BertEmbedding(nn.Module):
    """tokens, tokentype ids (b, s) -> dropout(word + position + token-type embedding) (b, s, h).

    `word_only`: the last stage's copy of the tied word embedding (see GPT's Embedding)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, word_only=False):
        super().__init__()
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.dropout = cfg.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab_size(state.tp_size),
            cfg.hidden_size,
            group=state.tp_group,
            init_method=None,
            device=device,
            dtype=dtype,
        )
        self.position_embeddings = self.tokentype_embeddings = None
        if not word_only:
            kw = {"device": device, "dtype": dtype}
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size, **kw)
            self.tokentype_embeddings = nn.Embedding(NUM_TOKENTYPES, cfg.hidden_size, **kw)

    def forward(self, tokens: torch.Tensor, tokentype_ids: torch.Tensor | None = None):
        positions = torch.arange(tokens.size(1), device=tokens.device)  # (s,)
        if tokentype_ids is None:
            tokentype_ids = torch.zeros_like(tokens)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        x = x + self.tokentype_embeddings(tokentype_ids)  # (b, s, h)
        return F.dropout(x, self.dropout if self.training else 0.0)


class BertHead(nn.Module):
    """h (b, s, h) -> (this rank's vocab slice of the MLM logits (b, s, V_pad / p),
    NSP logits (b, 2) or None). Padding-vocab logits are -inf, as in GPT's OutputHead."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, binary_head: bool):
        super().__init__()
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.tp_group = state.tp_group
        h, kw = cfg.hidden_size, {"device": device, "dtype": dtype}
        self.final_layernorm = build_norm(cfg, device, dtype)
        self.lm_dense = nn.Linear(h, h, **kw)
        self.lm_layernorm = build_norm(cfg, device, dtype)
        local = cfg.padded_vocab_size(state.tp_size) // state.tp_size
        self.lm_bias = nn.Parameter(torch.zeros(local, **kw))
        set_tensor_model_parallel_attributes(self.lm_bias, True, 0, 1)
        self.num_valid = max(0, min(local, cfg.vocab_size - state.tp_rank * local))
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        self.pooler = self.binary_head = None
        if binary_head:
            self.pooler = nn.Linear(h, h, **kw)
            self.binary_head = nn.Linear(h, 2, **kw)

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor):
        x = self.final_layernorm(x)
        nsp = None
        if self.binary_head is not None:
            nsp = self.binary_head(torch.tanh(self.pooler(x[:, 0])))  # (b, 2) from [CLS]
        y = F.gelu(self.lm_dense(x), approximate=self.gelu_approx)
        y = copy_to_tensor_model_parallel_region(self.lm_layernorm(y), self.tp_group)
        logits = F.linear(y, word_embeddings, self.lm_bias)  # (b, s, V_pad / p)
        if self.num_valid < logits.size(-1):
            logits[..., self.num_valid :] = float("-inf")
        return logits, nsp


class BertModel(nn.Module):
    """The BERT of `cfg` (or the slice `layer_range` of it, for a pipeline stage), TP-split.

    forward(tokens, padding_mask, tokentype_ids, lm_labels) on the last stage ->
    (per-token MLM loss (b, s) float32, NSP logits (b, 2) or None); without lm_labels the MLM
    logits take the loss's place. Other stages return hidden states (b, s, h)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: BuildContext | None = None,
        *,
        layer_range: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        binary_head: bool = True,
    ):
        super().__init__()
        if cfg.untie_embeddings_and_output_weights:
            raise ValueError("BERT ties its MLM output to the word embedding: drop --untie-*")
        ctx = start_chunk(self, cfg, ctx, pre_process, post_process)
        self.tied = self.shares_embedding = True
        layer_range = range(cfg.num_layers) if layer_range is None else layer_range
        self.embedding = chunk_embedding(
            BertEmbedding, cfg, ctx, pre_process, pre_process or post_process
        )
        self.layer_numbers = list(layer_range)
        kinds = layer_kinds(cfg)
        self.layers = nn.ModuleDict({str(i): build_layer(kinds, cfg, ctx, i) for i in layer_range})
        self.head = BertHead(cfg, ctx, binary_head) if post_process else None
        self._input: torch.Tensor | None = None
        init_weights(self, cfg, ctx.state, ctx.seed)

    def layer_list(self) -> list[nn.Module]:
        first = [self.embedding] if self.pre_process else []
        return [*first, *self.layers.values(), *([self.head] if self.head else [])]

    def word_embeddings_weight(self) -> torch.Tensor | None:
        return self.embedding.word_embeddings.weight if self.embedding is not None else None

    def set_input_tensor(self, x: torch.Tensor | None) -> None:
        self._input = x

    def forward(self, tokens, padding_mask, tokentype_ids=None, lm_labels=None):
        """padding_mask (b, s): 1 for real tokens, 0 for padding; every stage needs it."""
        x = self.embedding(tokens, tokentype_ids) if self.pre_process else self._input
        mask = AttentionMask.padding(padding_mask)  # bidirectional over the real tokens
        x = run_layers(
            list(self.layers.values()),
            x,
            None,
            mask,
            self.layer_recompute,
            self.rng_tracker,
            self.training,
        )
        if not self.post_process:
            return x
        logits, nsp = self.head(x, self.word_embeddings_weight())
        if lm_labels is None:
            return logits, nsp
        return self.ops.vocab_cross_entropy(logits, lm_labels, self.state.tp_group), nsp


def build_bert_model(
    cfg: ModelConfig, ctx: BuildContext, *, binary_head: bool = True
) -> ModelChunks:
    """This rank's pipeline stage of the BERT (one chunk; interleaving is GPT's only)."""
    state = ctx.state
    if state.virtual_pp_size:
        raise ValueError("BERT runs one model chunk per stage: drop --num-layers-per-virtual-*")
    model = BertModel(
        cfg,
        ctx,
        layer_range=stage_layer_range(cfg.num_layers, state.pp_size, state.pp_rank),
        pre_process=state.is_first_stage,
        post_process=state.is_last_stage,
        binary_head=binary_head,
    )
    return ModelChunks([model])
