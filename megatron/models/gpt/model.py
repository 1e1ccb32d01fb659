"""GPTModel: an ordered list of layers (embedding, N transformer layers, final norm + head).

Built from (ModelConfig, BuildContext) alone; recompute, torch.compile and sequence-parallel
marking are applied afterwards (megatron.model.parallelize). Parameter names do not depend on
the parallel layout (`layers.7.mlp...` is layer 7 wherever it lives), and every weight is drawn
from a generator seeded by (seed, name) on its full, unsharded shape before being sliced, so one
seed gives one model at any TP size (megatron.model.weights).

With --num-unique-layers N < L, layer i runs unique layer cfg.unique_layer(i), whose weights
exist once, under the name of the first layer that runs it (`cfg.layer_owner(i)`); autograd
sums the gradients of its uses, and checkpoints hold each unique layer once.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config.layer_pattern import layer_kinds
from megatron.config.schema import ModelConfig
from megatron.model.attention.masks import CAUSAL, AttentionMask
from megatron.model.attention.varlen import varlen_mask
from megatron.model.context import BuildContext, chunk_embedding, start_chunk
from megatron.model.layer_kinds import build_layer, check_layer_kinds
from megatron.model.mtp import MultiTokenPrediction
from megatron.model.norms import build_norm
from megatron.model.recompute import run_layers
from megatron.model.stages import ModelChunks, stage_layer_range
from megatron.model.transformer import split_dropout_rng
from megatron.model.weights import init_weights
from megatron.mpu.context_parallel import context_parallel_positions, gather_documents
from megatron.mpu.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    gathered_linear,
    local_linear,
)
from megatron.mpu.mappings import copy_to_tensor_model_parallel_region, sequence_slice
from megatron.schedules.base import virtual_stage


class Embedding(nn.Module):
    """tokens (b, s) -> dropout(word embedding + learned position embedding) (b, s, h).

    `word_only`: just the word-embedding table, the last pipeline stage's copy of a tied
    embedding (same name, same init; kept equal by all-reducing its gradient with stage 0's).
    Sequence parallel: the word lookup is reduce-scattered along the sequence, the positions of
    this TP rank's slice are added, and the output is (b, s/p, h).
    """

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, word_only: bool = False):
        super().__init__()
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.dropout = cfg.hidden_dropout
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.dropout_rng = split_dropout_rng(state, ctx.rng_tracker)
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab_size(state.tp_size),
            cfg.hidden_size,
            group=state.tp_group,
            init_method=None,
            device=device,
            dtype=dtype,
        )
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned" and not word_only:
            self.position_embeddings = nn.Embedding(
                cfg.max_positions, cfg.hidden_size, device=device, dtype=dtype
            )

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None):
        x = self.word_embeddings(tokens, self.sequence_parallel)  # (b, s, h) or (b, s/p, h)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.size(1), device=tokens.device)
            if self.sequence_parallel:  # (s,) or (b, s) -> this rank's s / p positions
                position_ids = sequence_slice(position_ids, self.tp_group, dim=-1)
            x = x + self.position_embeddings(position_ids)
        return self._dropout(x)

    def words(self, tokens: torch.Tensor) -> torch.Tensor:
        """dropout(word embedding) only: the multi-token prediction modules' input (their
        position is the hidden state's)."""
        return self._dropout(self.word_embeddings(tokens, self.sequence_parallel))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if p == 0.0:
            return x
        with self.dropout_rng():
            return nn.functional.dropout(x, p)


class OutputHead(nn.Module):
    """h (b, s, h) -> final norm -> this rank's vocab slice of the logits (b, s, V_pad / p).

    Logits of padding rows (ids >= the real vocab size) are -inf, so padding never takes softmax
    mass: the loss is the same whatever the padding, hence whatever the TP size.
    """

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.final_layernorm = build_norm(cfg, device, dtype)
        padded = cfg.padded_vocab_size(state.tp_size)
        local = padded // state.tp_size
        self.num_valid = max(0, min(local, cfg.vocab_size - state.tp_rank * local))
        self.output_layer = None
        self.weight_grad_split = None  # the tied head's (megatron.mpu.layers: a zero-bubble W)
        if cfg.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size,
                padded,
                group=state.tp_group,
                bias=False,
                init_method=None,
                sequence_parallel=state.sequence_parallel,
                device=device,
                dtype=dtype,
            )

    def forward(self, x, word_embeddings=None, labels=None, ops=None, with_normed=False):
        """This rank's vocab slice of the logits of final_layernorm(x); with `labels` the
        per-token loss instead (`loss`), and with `with_normed` also the normed x, where the
        multi-token prediction depths start. (One module call: DeepSpeed's ZeRO-3 gathers the
        tied embedding for it.)"""
        x = self.final_layernorm(x)
        if labels is None:
            return self.logits(x, word_embeddings)
        loss = self.normed_loss(x, labels, ops, word_embeddings)
        return (loss, x) if with_normed else loss

    def loss(self, x: torch.Tensor, labels: torch.Tensor, ops, word_embeddings=None):
        """Per-token loss (b, s) fp32 from h (b, s, h) or (b, s/p, h): the final norm, then the
        output layer and the vocab-parallel cross-entropy fused over chunks of tokens
        (--cross-entropy-fusion-impl linear; the padding masked there, by `num_valid`)."""
        return self.normed_loss(self.final_layernorm(x), labels, ops, word_embeddings)

    def normed_loss(self, x: torch.Tensor, labels: torch.Tensor, ops, word_embeddings=None):
        """`loss` of a normed x: the output layer and loss only (the MTP depths' own norms
        precede it)."""
        if ops.cross_entropy_fusion_impl != "linear":
            logits = self.logits(x, word_embeddings)
            return ops.vocab_cross_entropy(logits, labels, self.tp_group)
        weight = word_embeddings if self.output_layer is None else self.output_layer.weight
        if not self.sequence_parallel:  # backward: all-reduce dL/dx over TP
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        return ops.linear_cross_entropy(
            x, weight, labels, self.tp_group, self.sequence_parallel, self.num_valid
        )

    def logits(self, x: torch.Tensor, word_embeddings: torch.Tensor | None = None):
        """The projection after the final norm, with the padding masked: the only place that
        masks the logits it returns (DeepSpeed's pipeline layers, whose final norm is a layer of
        its own, call this too; `loss` masks its chunks). Sequence parallel: x is (b, s/p, h)
        and is all-gathered here (backward: reduce-scatter), so the logits and the
        vocab-parallel loss see the whole sequence."""
        if self.output_layer is not None:
            logits = self.output_layer(x)
        elif self.sequence_parallel:  # (b, s/p, h) -> (b, s, V / p)
            split = self.weight_grad_split
            logits = gathered_linear(x, word_embeddings, None, self.tp_group, split=split)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
            logits = local_linear(x, word_embeddings, split=self.weight_grad_split)
        if self.num_valid < logits.size(-1):
            logits[..., self.num_valid :] = float("-inf")
        return logits


class GPTModel(nn.Module):
    """The GPT of `cfg` (or the slice `layer_range` of it, for a pipeline stage), TP-split.

    forward(tokens, labels) -> per-token loss (b, s) in float32; without labels, this rank's
    vocab slice of the logits. A stage without the embedding (`pre_process=False`) takes its
    input from `set_input_tensor`; one without the head (`post_process=False`) returns hidden
    states.

    `kinds`: each layer's kind (megatron.model.layer_kinds); default the config's
    (megatron.config.layer_pattern.layer_kinds), given for a pattern no flag spells yet.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: BuildContext | None = None,
        *,
        layer_range: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        kinds: tuple[str, ...] | None = None,
    ):
        super().__init__()
        ctx = start_chunk(self, cfg, ctx, pre_process, post_process)
        self.tied = not cfg.untie_embeddings_and_output_weights
        # the last stage reads the word embedding too: the tied head's, or MTP's input
        self.shares_embedding = self.tied or cfg.mtp_num_layers is not None
        layer_range = range(cfg.num_layers) if layer_range is None else layer_range
        needed = pre_process or (post_process and self.shares_embedding)
        self.embedding = chunk_embedding(Embedding, cfg, ctx, pre_process, needed)
        self.layer_numbers = list(layer_range)  # the layers this chunk runs, in order
        self.layers = nn.ModuleDict()  # their weights: owner layer -> module
        kinds = layer_kinds(cfg) if kinds is None else check_layer_kinds(kinds, cfg)
        for i in layer_range:
            owner = cfg.layer_owner(i)
            if owner not in layer_range:
                raise ValueError(
                    f"layer {i} shares the weights of layer {owner}, which is not in this "
                    f"pipeline chunk ({layer_range}); see --param-sharing-style"
                )
            if str(owner) not in self.layers:
                self.layers[str(owner)] = build_layer(kinds, cfg, ctx, cfg.unique_layer(i))
        self.head = OutputHead(cfg, ctx) if post_process else None
        self.mtp = None  # --mtp-num-layers: after the head, on the last stage
        if post_process and cfg.mtp_num_layers is not None:
            self.mtp = MultiTokenPrediction(cfg, ctx)
        self._input: torch.Tensor | None = None
        init_weights(self, cfg, ctx.state, ctx.seed)

    def layer_list(self) -> list[nn.Module]:
        """The ordered layers; pipeline stages are contiguous slices of this list."""
        first = [self.embedding] if self.pre_process else []
        return [*first, *self.run_order(), *([self.head] if self.head else [])]

    def run_order(self) -> list[nn.Module]:
        """The transformer layers in the order they run (a shared one once per use)."""
        return [self.layers[str(self.cfg.layer_owner(i))] for i in self.layer_numbers]

    def word_embeddings_weight(self) -> torch.Tensor | None:
        return self.embedding.word_embeddings.weight if self.embedding is not None else None

    def set_input_tensor(self, x: torch.Tensor | None) -> None:
        """The activation received from the previous pipeline stage."""
        self._input = x

    def _attention_mask(self, document_ids: torch.Tensor | None) -> AttentionMask:
        """Causal, or within documents: by cu_seqlens (model/attention/varlen.py), or under
        context parallelism every chunk's document ids (one all-gather over CP per forward),
        which ring attention turns into per-block masks."""
        if document_ids is None:
            return CAUSAL
        if self.state.cp_size > 1:
            return AttentionMask.ring_documents(gather_documents(document_ids, self.state))
        return varlen_mask(document_ids)

    def forward(
        self,
        tokens=None,
        position_ids=None,
        labels=None,
        kv_caches=None,
        document_ids=None,
        loss_mask=None,
        attention_mask: AttentionMask | None = None,
    ):
        """`kv_caches`: {layer number: KVCache} for generation (see megatron.inference.engine).
        `position_ids`, `document_ids` (b, s): positions, and the document of each token that
        attention stays within (--reset-position-ids / --reset-attention-mask); every pipeline
        stage gets them (RoPE and the mask act in each layer). With context parallelism both are
        those of this rank's chunks. `loss_mask` (b, s): the tokens the loss keeps, which the
        multi-token prediction losses (training only) roll with the labels. `attention_mask`:
        a mask of any registered kind (model/attention/masks.py) in place of the one built
        from `document_ids`."""
        if kv_caches is not None and self.state.sequence_parallel:
            raise ValueError("generation with a KV cache runs without --sequence-parallel")
        cp = self.state.cp_size
        if position_ids is None and cp > 1 and tokens is not None:  # context parallel: tokens
            b, local = tokens.shape  # are chunks r and 2 CP - 1 - r of each sample
            position_ids = context_parallel_positions(
                b, local * cp, self.state.cp_rank, cp, tokens.device
            )
        x = self.embedding(tokens, position_ids) if self.pre_process else self._input
        mask = None
        if kv_caches is not None:
            for number, layer in zip(self.layer_numbers, self.run_order(), strict=True):
                x = layer(x, position_ids, kv_caches[number])
        else:
            mask = self._attention_mask(document_ids) if attention_mask is None else attention_mask
            x = run_layers(
                self.run_order(),
                x,
                position_ids,
                mask,
                self.layer_recompute,
                self.rng_tracker,
                self.training,
            )
        if not self.post_process:
            return x
        # untied: the head has its own weight, and the embedding's (under FSDP2 a sharded
        # parameter outside the embedding's forward) is not handed to it
        weight = self.word_embeddings_weight() if self.tied else None
        # evaluation and generation skip the MTP depths
        mtp = self.mtp is not None and mask is not None and labels is not None
        mtp = mtp and self.training and torch.is_grad_enabled()
        if not mtp and (labels is None or self.ops.cross_entropy_fusion_impl != "linear"):
            # the loss after the head's call: under --torch-compile the (Triton) loss is then
            # the one graph break, at the end (inside the head it cut the graph in three)
            logits = self.head(x, weight)
            if labels is None:
                return logits
            return self.ops.vocab_cross_entropy(logits, labels, self.state.tp_group)
        out = self.head(x, weight, labels, self.ops, with_normed=mtp)
        if not mtp:
            return out
        loss, x = out
        return self.mtp(
            loss,
            x,
            tokens,
            labels,
            loss_mask,
            self.embedding.words,
            lambda h, target: self.head.normed_loss(h, target, self.ops, weight),
            position_ids=position_ids,
            mask=mask,
            recompute=self.layer_recompute,
            tracker=self.rng_tracker,
        )


def build_model(cfg: ModelConfig, ctx: BuildContext) -> ModelChunks:
    """This rank's chunks of the GPT; the same seed gives the same weights at any TP/PP/V."""
    state, vp = ctx.state, ctx.state.virtual_pp_size
    P, v_shape, chunks = state.pp_size, state.pipeline_v, []
    for c in range(vp or 1):
        virtual = virtual_stage(P, state.pp_rank, c, v_shape)
        chunks.append(
            GPTModel(
                cfg,
                ctx,
                layer_range=stage_layer_range(cfg.num_layers, P, state.pp_rank, vp, c, v_shape),
                pre_process=virtual == 0,
                post_process=virtual == P * (vp or 1) - 1,
            )
        )
    first, last = chunks[0], chunks[-1]
    if v_shape and state.pp_rank == 0 and last.tied:  # the V: one word embedding, two chunks
        last.embedding.word_embeddings.weight = first.embedding.word_embeddings.weight
    return ModelChunks(chunks)
