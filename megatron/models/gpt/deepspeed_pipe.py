"""The GPT as a DeepSpeed `PipelineModule` (--deepspeed with --pipeline-model-parallel-size > 1).

The same pieces as GPTModel (embedding, transformer layers, final norm, head; the tied embedding
through `TiedLayerSpec`), each a pipeline layer with one tensor in and one out, or, under the
document options, the tuple (tensor, position_ids, document_ids) (b, s) each (see the engine's
PipeBatches). Every layer draws the weights GPTModel would (same names, same seed).
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from megatron.config.layer_pattern import layer_kinds
from megatron.config.schema import MegatronConfig, ModelConfig
from megatron.model.attention.masks import CAUSAL
from megatron.model.attention.varlen import varlen_mask
from megatron.model.context import BuildContext
from megatron.model.layer_kinds import attention_kind
from megatron.model.norms import build_norm
from megatron.model.parallelize import parallelize
from megatron.model.transformer import TransformerLayer
from megatron.model.weights import init_weights
from megatron.models.gpt.model import Embedding, OutputHead
from megatron.models.gpt.train import lm_loss
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.training.deepspeed.engine import import_deepspeed
from megatron.training.step import build_context


class EmbeddingPipe(Embedding):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__(cfg, ctx)
        init_weights(self, cfg, ctx.state, ctx.seed, prefix="embedding.")
        parallelize(self, ctx.state)

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            tokens, position_ids, document_ids = inputs
            return super().forward(tokens, position_ids), position_ids, document_ids
        return super().forward(inputs)


class TransformerLayerPipe(TransformerLayer):
    """`document_mask`: attend within documents (--reset-attention-mask); each layer builds
    the mask from the document ids it passes on. Full recompute is DeepSpeed's
    (activation_checkpoint_interval); selective recompute is applied here. `kind`: the layer's
    (megatron.model.layer_kinds), an attention kind."""

    def __init__(
        self, cfg, ctx: BuildContext, number: int, kind: str, recompute, document_mask=False
    ):
        kind_ = attention_kind(kind)
        super().__init__(cfg, ctx, number + 1, kind_.feed_forward, kind_.window(cfg))
        init_weights(self, cfg, ctx.state, ctx.seed, prefix=f"layers.{number}.")
        if recompute.granularity == "selective":
            parallelize(self, ctx.state, recompute)
        else:
            parallelize(self, ctx.state)
        self.document_mask = document_mask

    def forward(self, inputs):
        if not isinstance(inputs, tuple):
            return super().forward(inputs)
        x, position_ids, document_ids = inputs
        mask = varlen_mask(document_ids) if self.document_mask else CAUSAL
        return super().forward(x, position_ids, None, mask), position_ids, document_ids


class FinalNormPipe(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.final_layernorm = build_norm(cfg, ctx.device, ctx.dtype)
        init_weights(self, cfg, ctx.state, ctx.seed, prefix="head.")
        parallelize(self, ctx.state)

    def forward(self, inputs):
        return self.final_layernorm(inputs[0] if isinstance(inputs, tuple) else inputs)


class HeadPipe(OutputHead):
    """The untied output layer (the final norm is FinalNormPipe)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__(cfg, ctx)
        del self.final_layernorm
        init_weights(self, cfg, ctx.state, ctx.seed, prefix="head.")

    def forward(self, x):
        return self.logits(x)


def _tied_logits(head: OutputHead, module: EmbeddingPipe, x):
    """The last stage's copy of the tied embedding as the output layer (padding masked)."""
    return head.logits(x, module.word_embeddings.weight)


class _LossPipe:
    """The pipeline engine's loss: the native path's lm_loss over the per-token cross entropy,
    with the loss mask PipeBatches sends beside the labels."""

    def __init__(self, tp_group, upcast: bool = True):
        self.tp_group, self.upcast = tp_group, upcast

    def __call__(self, logits, labels_and_mask):
        labels, loss_mask = labels_and_mask
        per_token = vocab_parallel_cross_entropy(logits, labels, self.tp_group, self.upcast)
        return lm_loss(loss_mask, per_token)[0]


def build_pipeline_module(cfg: MegatronConfig, rt, checkpoint_fn):
    deepspeed = import_deepspeed()
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    m, st = cfg.model, rt.state
    ctx = build_context(cfg, rt)
    common = (cfg.model, ctx)
    tied = not m.untie_embeddings_and_output_weights
    embed = (
        TiedLayerSpec("embed", EmbeddingPipe, *common, tied_weight_attr="word_embeddings.weight")
        if tied
        else LayerSpec(EmbeddingPipe, *common)
    )
    if tied:
        # A weightless head (meta device) that computes the logits with the tied weight.
        meta = dataclasses.replace(ctx, device="meta")
        head_fn = functools.partial(_tied_logits, OutputHead(m, meta))
        head = TiedLayerSpec(
            "embed",
            EmbeddingPipe,
            *common,
            tied_weight_attr="word_embeddings.weight",
            forward_fn=head_fn,
        )
    else:
        head = LayerSpec(HeadPipe, *common)
    pipe_layer = functools.partial(LayerSpec, TransformerLayerPipe, m, ctx)
    layers = [
        embed,
        *(
            pipe_layer(i, kind, cfg.recompute, cfg.data.reset_attention_mask)
            for i, kind in enumerate(layer_kinds(m))
        ),
        LayerSpec(FinalNormPipe, *common),
        head,
    ]
    topology = PipeModelDataParallelTopology(
        num_pp=st.pp_size, num_mp=st.tp_size, num_dp=st.dp_size
    )
    recompute = cfg.recompute.granularity == "full"
    del deepspeed
    return PipelineModule(
        layers=layers,
        loss_fn=_LossPipe(st.tp_group, upcast=not cfg.kernels.fp16_lm_cross_entropy),
        topology=topology,
        partition_method="type:TransformerLayerPipe",
        activation_checkpoint_interval=cfg.recompute.num_layers if recompute else 0,
        activation_checkpoint_func=checkpoint_fn,
        # Transformer layers only: DeepSpeed's default also checkpoints the embedding, whose
        # inputs (token ids) need no grad, so stage 0's output had none and backward failed.
        checkpointable_layers=["TransformerLayerPipe"],
    )
