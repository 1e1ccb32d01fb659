"""GPTModel: an ordered list of layers (embedding, N transformer layers, final norm + head).

Parameter names do not depend on the parallel layout (`layers.7.mlp...` is layer 7 wherever it
lives), and every weight is drawn from a generator seeded by (seed, name) on its full,
unsharded shape before being sliced, so one seed gives one model at any TP size.

With --num-unique-layers N < L, layer i runs unique layer cfg.unique_layer(i), whose weights
exist once, under the name of the first layer that runs it (`cfg.layer_owner(i)`); autograd
sums the gradients of its uses, and checkpoints hold each unique layer once.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from megatron.config.schema import ModelConfig, RecomputeConfig
from megatron.fused_kernels import TORCH_OPS, FusedOps
from megatron.model.documents import document_attention_mask
from megatron.model.stages import ModelChunks, stage_layer_range
from megatron.model.transformer import (
    NORM_TYPES,
    TransformerLayer,
    build_norm,
    split_dropout_rng,
)
from megatron.mpu import (
    ColumnParallelLinear,
    ParallelState,
    RNGStatesTracker,
    VocabParallelEmbedding,
    checkpoint,
    copy_full_into_param,
    copy_to_tensor_model_parallel_region,
    gathered_linear,
    mark_sequence_parallel,
    sequence_slice,
)

# Output projections of residual branches get std / sqrt(2 x num_layers) (GPT-2's scaled init).
_SCALED_INIT_SUFFIXES = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_WEIGHTS = "head.output_layer.weight"


class Embedding(nn.Module):
    """tokens (b, s) -> dropout(word embedding + learned position embedding) (b, s, h).

    `word_only`: just the word-embedding table, the last pipeline stage's copy of a tied
    embedding (same name, same init; kept equal by all-reducing its gradient with stage 0's).
    Sequence parallel: the word lookup is reduce-scattered along the sequence, the positions of
    this TP rank's slice are added, and the output is (b, s/p, h).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        state: ParallelState,
        device=None,
        dtype=None,
        word_only: bool = False,
        rng_tracker: RNGStatesTracker | None = None,
    ):
        super().__init__()
        self.dropout = cfg.hidden_dropout
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.dropout_rng = split_dropout_rng(state, rng_tracker)
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

    def __init__(self, cfg: ModelConfig, state: ParallelState, device=None, dtype=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.final_layernorm = build_norm(cfg, device, dtype)
        padded = cfg.padded_vocab_size(state.tp_size)
        local = padded // state.tp_size
        self.num_valid = max(0, min(local, cfg.vocab_size - state.tp_rank * local))
        self.output_layer = None
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

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor | None = None):
        return self.logits(self.final_layernorm(x), word_embeddings)

    def logits(self, x: torch.Tensor, word_embeddings: torch.Tensor | None = None):
        """The projection after the final norm, with the padding masked: the only place that
        masks it (DeepSpeed's pipeline layers, whose final norm is a layer of its own, call
        this too). Sequence parallel: x is (b, s/p, h) and is all-gathered here (backward:
        reduce-scatter), so the logits and the vocab-parallel loss see the whole sequence."""
        if self.output_layer is not None:
            logits = self.output_layer(x)
        elif self.sequence_parallel:  # (b, s/p, h) -> (b, s, V / p)
            logits = gathered_linear(x, word_embeddings, None, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
            logits = nn.functional.linear(x, word_embeddings)
        if self.num_valid < logits.size(-1):
            logits[..., self.num_valid :] = float("-inf")
        return logits


class GPTModel(nn.Module):
    """The GPT of `cfg` (or the slice `layer_range` of it, for a pipeline stage), TP-split.

    forward(tokens, labels) -> per-token loss (b, s) in float32; without labels, this rank's
    vocab slice of the logits. A stage without the embedding (`pre_process=False`) takes its
    input from `set_input_tensor`; one without the head (`post_process=False`) returns hidden
    states.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        state: ParallelState,
        *,
        rng_tracker: RNGStatesTracker | None = None,
        seed: int = 1234,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        layer_range: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        checkpoint_impl=None,
        ops: FusedOps | None = None,
        recompute: RecomputeConfig | None = None,
        torch_compile: bool = False,
    ):
        super().__init__()
        self.ops = ops or TORCH_OPS
        # The run-time switches (ops, recompute, compile) come apart from the architecture `cfg`:
        # they change how the model computes, never its weights, so checkpoints leave them out.
        self.recompute = recompute or RecomputeConfig()
        self.cfg, self.state, self.rng_tracker = cfg, state, rng_tracker
        self.checkpoint_impl = checkpoint_impl  # e.g. DeepSpeed's, for --deepspeed recompute
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = not cfg.untie_embeddings_and_output_weights
        layer_range = range(cfg.num_layers) if layer_range is None else layer_range
        self.embedding = None
        if pre_process or (post_process and self.tied):
            self.embedding = Embedding(
                cfg, state, device, dtype, word_only=not pre_process, rng_tracker=rng_tracker
            )
            if not pre_process:
                self.embedding.word_embeddings.weight.shared = True  # counted once in norms
        self.layer_numbers = list(layer_range)  # the layers this chunk runs, in order
        self.layers = nn.ModuleDict()  # their weights: owner layer -> module
        for i in layer_range:
            owner = cfg.layer_owner(i)
            if owner not in layer_range:
                raise ValueError(
                    f"layer {i} shares the weights of layer {owner}, which is not in this "
                    f"pipeline chunk ({layer_range}); see --param-sharing-style"
                )
            if str(owner) not in self.layers:
                self.layers[str(owner)] = TransformerLayer(
                    cfg,
                    state,
                    rng_tracker,
                    device,
                    dtype,
                    self.ops,
                    self.recompute,
                    layer_number=cfg.unique_layer(i) + 1,
                )
        self.head = OutputHead(cfg, state, device, dtype) if post_process else None
        self._input: torch.Tensor | None = None
        init_weights(self, cfg, state, seed)
        mark_sequence_parallel_params(self, state)
        if torch_compile:  # compile the forward, not the module: parameter names stay
            for layer in self.layers.values():
                layer.forward = torch.compile(layer.forward)

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

    def forward(
        self, tokens=None, position_ids=None, labels=None, kv_caches=None, document_ids=None
    ):
        """`kv_caches`: {layer number: KVCache} for generation (see megatron.inference.engine).
        `position_ids`, `document_ids` (b, s): positions, and the document of each token that
        attention stays within (--reset-position-ids / --reset-attention-mask); every pipeline
        stage gets them (RoPE and the mask act in each layer)."""
        if kv_caches is not None and self.state.sequence_parallel:
            raise ValueError("generation with a KV cache runs without --sequence-parallel")
        x = self.embedding(tokens, position_ids) if self.pre_process else self._input
        mask = None if document_ids is None else document_attention_mask(document_ids)
        if kv_caches is not None:
            for number, layer in zip(self.layer_numbers, self.run_order(), strict=True):
                x = layer(x, position_ids, kv_caches[number])
        else:
            x = run_layers(
                self.run_order(),
                x,
                position_ids,
                self.recompute,
                self.rng_tracker,
                self.training,
                self.checkpoint_impl,
                mask,
            )
        if not self.post_process:
            return x
        logits = self.head(x, self.word_embeddings_weight())
        if labels is None:
            return logits
        return self.ops.vocab_cross_entropy(logits, labels, self.state.tp_group)


def run_layers(
    layers,
    x,
    position_ids,
    recompute: RecomputeConfig,
    tracker,
    training: bool,
    impl=None,
    attention_mask=None,
):
    """Run the transformer layers, recomputing activations as --recompute-* asks.

    full + uniform: checkpoint every group of N consecutive layers; full + block: checkpoint
    the first N layers only. (Selective recompute lives inside the attention layer.) The mask
    goes last: DeepSpeed's activation partitioning leaves non-float arguments whole.
    """
    extra = (position_ids, None, attention_mask)  # (position ids, no KV cache, mask)
    if recompute.granularity != "full" or not training:
        for layer in layers:
            x = layer(x, *extra)
        return x
    n = recompute.num_layers
    if recompute.method == "block":
        for i, layer in enumerate(layers):
            x = checkpoint(layer, tracker, x, *extra, impl=impl) if i < n else layer(x, *extra)
        return x
    for start in range(0, len(layers), n):
        group = layers[start : start + n]
        x = checkpoint(_Sequential(group), tracker, x, *extra, impl=impl)
    return x


class _Sequential:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x, *extra):
        for layer in self.layers:
            x = layer(x, *extra)
        return x


def mark_sequence_parallel_params(model: nn.Module, state: ParallelState) -> None:
    """With sequence parallelism, mark the replicated parameters that see only this TP rank's
    s / p tokens (norm weights and biases, the position table; row-parallel biases mark
    themselves), so their gradients are summed over TP before the optimizer."""
    if not state.sequence_parallel:
        return
    for module in model.modules():
        if isinstance(module, NORM_TYPES):
            for param in module.parameters(recurse=False):
                mark_sequence_parallel(param)
        if isinstance(module, Embedding) and module.position_embeddings is not None:
            mark_sequence_parallel(module.position_embeddings.weight)


def _generator(seed: int, name: str) -> torch.Generator:
    # crc32 is stable across processes and Python versions (hash() is salted).
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _full_shape(param: torch.Tensor, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


@torch.no_grad()
def init_weights(
    model: nn.Module, cfg: ModelConfig, state: ParallelState, seed: int, prefix: str = ""
) -> None:
    """Initialize every parameter from (seed, name) on its full shape, then keep this rank's slice.

    `prefix` names a piece built on its own (a DeepSpeed pipeline layer) as it is named inside
    GPTModel, so it draws exactly the same weights.

    Norm weights 1, biases 0, other weights N(0, std) with std / sqrt(2 L) for the output
    projections of residual branches. Vocab-sized weights draw only the real vocab rows, with
    zero padding rows, so the draw does not depend on how far the vocab was padded.
    """
    norm_params = {
        f"{mname}.{pname}"
        for mname, m in model.named_modules()
        if isinstance(m, NORM_TYPES)
        for pname, _ in m.named_parameters(recurse=False)
    }
    scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    for local_name, param in model.named_parameters():
        name = prefix + local_name
        full = torch.empty(_full_shape(param, state.tp_size), dtype=torch.float32)
        if local_name in norm_params:
            full.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            full.zero_()
        else:
            std = scaled_std if name.endswith(_SCALED_INIT_SUFFIXES) else cfg.init_method_std
            rows = cfg.vocab_size if name in (WORD_EMBEDDINGS, OUTPUT_WEIGHTS) else full.shape[0]
            full.zero_()
            full[:rows].normal_(0.0, std, generator=_generator(seed, name))
        copy_full_into_param(param, full, state.tp_group)


def build_model(
    cfg: ModelConfig,
    state: ParallelState,
    *,
    rng_tracker: RNGStatesTracker | None,
    seed: int,
    device=None,
    dtype=torch.float32,
    checkpoint_impl=None,
    ops=None,
    recompute: RecomputeConfig | None = None,
    torch_compile: bool = False,
) -> ModelChunks:
    """This rank's chunks of the GPT; the same seed gives the same weights at any TP/PP/V.

    `ops`, `recompute` and `torch_compile` are the run-time switches (see GPTModel)."""
    vp = state.virtual_pp_size
    chunks = []
    for c in range(vp or 1):
        last_chunk = c == (vp or 1) - 1
        chunks.append(
            GPTModel(
                cfg,
                state,
                rng_tracker=rng_tracker,
                seed=seed,
                device=device,
                dtype=dtype,
                layer_range=stage_layer_range(cfg.num_layers, state.pp_size, state.pp_rank, vp, c),
                checkpoint_impl=checkpoint_impl,
                ops=ops,
                recompute=recompute,
                torch_compile=torch_compile,
                pre_process=state.is_first_stage and c == 0,
                post_process=state.is_last_stage and last_chunk,
            )
        )
    return ModelChunks(chunks)
