"""Bytes per rank of a parallel layout: parameters, gradients, optimizer state, activations.

Parameters of a rank are counted exactly from the model's shapes (the layers of its pipeline
stage split over TP, the embedding on the first stage, the final norm and head, or the tied
embedding's copy, on the last). Per parameter the native trainer keeps D bytes of weights
(D = 2 for fp16/bf16, 4 for fp32), a 4-byte fp32 gradient buffer, and Adam's state: fp32 master
+ two moments = 12 bytes in half precision, the two moments = 8 in fp32. The distributed
optimizer (ZeRO-1) divides the optimizer state by DP (D + 4 + 12/DP bytes per parameter in
bf16, 8 + 8/DP in fp32); ZeRO-2 also the gradients, ZeRO-3 also the weights.

Activations kept for backward by one transformer layer for one micro batch of b sequences of s
tokens, u = s b h elements (Korthikanti et al. 2022, Megatron's 34 s b h + 5 a s^2 b in fp16):

    outside the TP regions  4 D u + 2 M u       (norm inputs and outputs, the two residual
                                                  dropout masks of M bytes); / t with SP
    inside the TP regions   D s b (qkv + ctx + 2 ffn) / t = 12 D u / t for a 4h GeLU MLP
    attention core          a s^2 b (2 D + M) / t with a score matrix (unfused, or CPU SDPA with
                            attention dropout); 4 a s b / t (the log-sum-exp) for flash SDPA
    norm statistics         2 norms x 2 x 4 s b bytes; / t with SP

Mixture of experts (--num-experts E, top-k, expert width f): an MoE layer holds the router
(E h), its shared expert (split over TP) and E / EP experts, their FFN split over ETP
(--expert-tensor-parallel-size, 1 or TP, default TP); their gradients and optimizer state
shard over the DP x CP / EP ranks holding the same experts. Its activations replace the MLP's
by the dispatch buffers of the T = s b / t (SP at ETP 1) or s b tokens a rank dispatches, per
(token, expert) slot D (3 h + 2 f / ETP) with GeLU experts, D (3 h + 4 f / ETP) with SwiGLU
(the permuted tokens, the experts' inner activations, their outputs, the combine's input;
+ D h with EP > 1, the received copy), and the fp32 router scores 12 T E.

Context parallelism (CP ranks per sequence) gives each rank s / CP tokens: every activation
term above is taken at s / CP, and the attention core is the ring's (mpu/context_parallel.py):
the query copy and the log-sum-exp, D a s b d / t + 4 a s b / t at s / CP (in half precision
with the explicit block math, not SDPA's fused kernels, also its fp32 output, 4 a s b d / t),
never a score matrix. Parameters are replicated over CP:
the distributed optimizer shards over DP x CP.

Multi-latent attention's parameters, latents, heads and kernel: megatron/planning/mla.py.

Selective recompute drops the attention core; full recompute keeps each group's input (D u,
/ t with SP) and rebuilds one group of layers at a time in backward (the recompute working set).
The first virtual stage adds the token and position ids and the embedding's dropout mask, the
last the final norm, the fp32 logits 4 s b V / t (with --cross-entropy-fusion-impl linear, an
fp32 log-sum-exp per token instead) and the labels. The micro batches a pipeline stage holds
at once, walked in its schedule's own order, and the rank's total: planning/pipeline_memory.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.config.optimizers import get_kind
from megatron.config.schema import ModelConfig
from megatron.planning import mla
from megatron.schedules.base import PipelineSchedule
from megatron.schedules.registry import is_default, resolve_schedule

GiB = 1024**3


def gib_above(need_bytes: int, limit_gib: float) -> tuple[str, str]:
    """(need, enough) for a need over a limit of `limit_gib` GiB, both in GiB with the fewest
    decimals (at least one, and at least the limit's own) at which the need reads above the
    limit, so "needs 1.0 GiB" is never said to a 1 GiB GPU: the need rounded to nearest, and
    the smallest value at those decimals that holds it (rounded up: a memory flag's value)."""
    digits = max(1, len(f"{limit_gib:g}".partition(".")[2]))
    while digits < 12 and float(f"{need_bytes / GiB:.{digits}f}") <= limit_gib:
        digits += 1  # 12 decimals tell one byte from the next
    scale = 10**digits
    enough = -(-need_bytes * scale // GiB)  # ceil, in units of 10**-digits GiB
    return f"{need_bytes / GiB:.{digits}f}", f"{enough / scale:.{digits}f}"


@dataclass(frozen=True)
class Layout:
    """One way to run: TP x CP x PP x DP ranks, V model chunks per stage (None: not
    interleaved), M micro batches of b samples per step, recompute and sequence parallelism."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    vp: int | None = None
    recompute: str | None = None  # None, "selective", "full"
    sequence_parallel: bool = False
    cp: int = 1  # context-parallel ranks per sequence
    ep: int = 1  # expert-parallel ranks (MoE), carved from DP x CP
    etp: int | None = None  # expert-tensor-parallel ranks: 1 or TP (None: TP, the default)
    schedule: str | None = None  # --pipeline-schedule (None: the default for vp)

    @property
    def pipeline(self) -> PipelineSchedule:
        """The schedule object (megatron.schedules): the one named, or the default for vp."""
        return resolve_schedule(self.schedule, chunked=bool(self.vp))

    @property
    def pipeline_schedule(self) -> str:
        return self.pipeline.name

    @property
    def v_shape(self) -> bool:
        """The chunks placed in a V (ZBV, DualPipeV): stage 0 holds the embedding and head."""
        return self.pipeline.v_shape

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def describe(self) -> str:
        v = f" V{self.vp}" if self.vp and not self.v_shape else ""
        v += f" {self.schedule}" if self.schedule and not is_default(self.schedule) else ""
        sp = " SP" if self.sequence_parallel else ""
        rc = f" rc={self.recompute}" if self.recompute else ""
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        ep += " ETP1" if self.expert_tp == 1 and self.tp > 1 else ""
        return f"TP{self.tp}{cp} PP{self.pp}{v} DP{self.dp}{ep} mb{self.micro_batch}{sp}{rc}"


@dataclass(frozen=True)
class Device:
    """What the memory model needs to know about the device and the framework.

    `mask_bytes`: one dropout-mask element (CUDA keeps bool masks; CPU keeps a mask in the
    activation dtype). `flash_attention`: SDPA keeps O(s) per head (CUDA flash / memory-efficient
    kernels; CPU only without attention dropout). `overhead_bytes`: the framework's own memory
    (CUDA context, allocator caching, workspaces): a constant measured once per setup."""

    mask_bytes: int = 1
    flash_attention: bool = True
    overhead_bytes: int = 0


@dataclass(frozen=True)
class Training:
    """The run settings the memory model reads besides the model and the layout."""

    dtype_bytes: int = 2  # weights and activations: 2 for fp16/bf16, 4 for fp32
    optimizer: str = "adam"  # a name of megatron.config.optimizers (its state bytes)
    sgd_momentum: float = 0.9
    sharding: str = "none"  # none, distributed (= ZeRO-1), zero2, zero3, fsdp2
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    attention_backend: str = "sdpa"
    cross_entropy_fusion_impl: str = "native"  # linear: no logits kept, a log-sum-exp per token


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of the fullest rank (pipeline stage `stage`), term by term."""

    stage: int
    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


# ---- parameters ----


def norm_params(m: ModelConfig) -> int:
    return 2 * m.hidden_size if m.normalization == "LayerNorm" else m.hidden_size


def mlp_params(m: ModelConfig, ffn: int, tp: int) -> int:
    """An MLP of inner width `ffn` split over `tp` ranks (its output bias replicated)."""
    h, bias, ffn = m.hidden_size, int(m.add_bias_linear), ffn // tp
    fc1 = ffn * (2 if m.swiglu else 1)
    return h * fc1 + fc1 * bias + ffn * h + h * bias


def layer_params(m: ModelConfig, tp: int, moe: bool = False) -> int:
    """Weights of one transformer layer on one TP rank (row-parallel biases are replicated);
    `moe`: an MoE layer's, its experts excepted (expert_params)."""
    h, hd, bias = m.hidden_size, m.head_dim, int(m.add_bias_linear)
    qkv = (m.num_attention_heads + 2 * m.query_groups) * hd // tp
    ctx = m.num_attention_heads * hd // tp
    attention = h * qkv + qkv * bias + ctx * h + h * bias + 2 * norm_params(m)
    if m.multi_latent_attention:  # planning/mla.py
        attention = mla.attention_params(m, tp) + 2 * norm_params(m)
    if not moe:
        return attention + mlp_params(m, m.ffn_size, tp)
    shared = m.moe_shared_expert_intermediate_size
    gate = h if m.moe_shared_expert_gate else 0
    return attention + m.num_experts * h + (mlp_params(m, shared, tp) + gate if shared else 0)


def expert_params(m: ModelConfig, ep: int, etp: int = 1) -> int:
    """The experts of one MoE layer on one EP rank, their FFN split over `etp` ranks (bias2
    whole on each)."""
    return m.num_experts // ep * mlp_params(m, m.expert_ffn_size, etp)


def stage_moe_layers(m: ModelConfig, pp: int, stage: int) -> int:
    """MoE layers of pipeline stage `stage` (its contiguous L / P layers)."""
    n = m.num_layers // pp
    return sum(m.is_moe_layer(i) for i in range(stage * n, (stage + 1) * n))


def stage_expert_params(m: ModelConfig, pp: int, stage: int, ep: int, etp: int = 1) -> int:
    """Expert weights on a rank of stage `stage` (sharded over DP x CP / EP, not DP)."""
    return stage_moe_layers(m, pp, stage) * expert_params(m, ep, etp) if m.moe else 0


def stage_params(
    m: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1, etp: int = 1, v_shape=False
) -> int:
    """Weights on a rank of pipeline stage `stage` (its V chunks together), experts included.
    `v_shape` (ZBV, DualPipeV): stage 0 holds the head too, and one tied embedding for both."""
    words = m.padded_vocab_size(tp) * m.hidden_size // tp
    moe = stage_moe_layers(m, pp, stage)
    n = (m.num_layers // pp - moe) * layer_params(m, tp)
    n += moe * layer_params(m, tp, moe=True) if moe else 0
    n += stage_expert_params(m, pp, stage, ep, etp)
    if stage == 0:
        n += words + (
            m.max_positions * m.hidden_size if m.position_embedding_type == "learned" else 0
        )
    if stage == (0 if v_shape else pp - 1):
        n += norm_params(m)
        if m.untie_embeddings_and_output_weights or (pp > 1 and not v_shape):
            n += words  # the output head, or the tied embedding's copy on the last stage
        if m.untie_embeddings_and_output_weights and pp > 1 and m.mtp_num_layers:
            n += words  # the untied head and multi-token prediction's embedding copy
        n += mtp_params(m, tp, ep, etp)
    return n


def mtp_params(m: ModelConfig, tp: int, ep: int = 1, etp: int = 1) -> int:
    """The --mtp-num-layers depths on the last stage: each three norms, the column-parallel
    eh_proj (2h -> h) and a layer of the last layer's kind."""
    if not m.mtp_num_layers:
        return 0
    moe = m.is_moe_layer(m.num_layers - 1)
    layer = layer_params(m, tp, moe=moe) + (expert_params(m, ep, etp) if moe else 0)
    return m.mtp_num_layers * (3 * norm_params(m) + 2 * m.hidden_size**2 // tp + layer)


def model_state_bytes(
    params: int, dp: int, t: Training, experts: int = 0, ep: int = 1
) -> dict[str, int]:
    """Weights, fp32 gradient buffer and optimizer state of `params` parameters, of which
    `experts` are MoE experts, sharded over the dp / ep ranks holding the same experts."""
    half = t.dtype_bytes < 4
    opt = (4 if half else 0) + get_kind(t.optimizer).state_bytes(t)  # masters + state
    if t.sharding == "fsdp2":  # fp32 shards of weights (the masters), gradients, moments
        opt -= 4 if half else 0
        return {
            "parameters": 4 * params // dp,
            "gradients": 4 * params // dp,
            "optimizer": opt * params // dp,
        }
    shard = {"none": 0, "distributed": 1, "zero2": 2, "zero3": 3}[t.sharding]
    dense, edp = params - experts, max(1, dp // ep)

    def sharded(per: int, level: int) -> int:
        return dense * per // (dp if shard >= level else 1) + experts * per // (
            edp if shard >= level else 1
        )

    return {
        "parameters": sharded(t.dtype_bytes, 3),
        "gradients": sharded(4, 2),
        "optimizer": sharded(opt, 1),
    }


# ---- activations of one micro batch ----


def _attention_core_bytes(m: ModelConfig, lay: Layout, t: Training, dev: Device) -> int:
    """What the attention kernel keeps (a s^2 b score matrices, or a s b log-sum-exps)."""
    a, s, b, D = m.num_attention_heads // lay.tp, m.seq_length, lay.micro_batch, t.dtype_bytes
    if lay.cp > 1:  # ring attention (m is this rank's s / CP tokens): no score matrix; the
        # query copy, the log-sum-exp, and in half precision with the explicit block math the
        # fp32 output besides the ctx (fp32, or fused kernels: it keeps the tensor it returns)
        fused = t.attention_backend == "sdpa" and dev.flash_attention
        out = 4 if D < 4 and not fused else 0
        return (D + out) * a * s * b * m.head_dim + 4 * a * s * b
    scores = t.attention_backend != "sdpa" or not dev.flash_attention
    if not scores:
        return 4 * a * s * b
    per = 2 * D + dev.mask_bytes if m.attention_dropout > 0 else D
    # With b = 1 the (a s, d) view of v needs no copy, so the whole fused qkv output stays
    # alive (q and k are copied either way): (a + g) d more per token than a copy of v.
    qkv_view = D * s * (m.num_attention_heads + m.query_groups) * m.head_dim // lay.tp
    return a * s * s * b * per + (qkv_view if b == 1 else 0)


def layer_activation_bytes(
    m: ModelConfig, lay: Layout, t: Training, dev: Device, *, core: bool = True, moe=False
) -> int:
    """Bytes one layer keeps for backward for one micro batch (no full recompute); `core`:
    whether the attention core's are kept (False under selective recompute); `moe`: an MoE
    layer's (dispatch buffers instead of the MLP's)."""
    s, b, h, D, tp = m.seq_length, lay.micro_batch, m.hidden_size, t.dtype_bytes, lay.tp
    sp = tp if lay.sequence_parallel else 1
    masks = 2 * dev.mask_bytes if m.hidden_dropout > 0 else 0
    outside = (4 * D + masks) * s * b * h // sp + 2 * 2 * 4 * s * b // sp
    hd = m.head_dim
    width = (m.num_attention_heads + 2 * m.query_groups) * hd + m.num_attention_heads * hd
    mlp = 3 if m.swiglu else 2
    if moe:
        width += mlp * (m.moe_shared_expert_intermediate_size or 0)
    else:
        width += mlp * m.ffn_size
    if m.multi_latent_attention:  # its latents, heads and kernel instead (planning/mla.py)
        width -= (m.num_attention_heads + 2 * m.query_groups) * hd + m.num_attention_heads * hd
        attention = mla.activation_bytes(m, s * b, tp, sp, D, core)
    inside = D * s * b * width // tp
    if moe:  # the tokens this rank dispatches: its s / t with SP (all s when ETP gathers them)
        etp = lay.expert_tp
        tokens = s * b // (sp if etp == 1 else 1)
        k, f = m.moe_router_topk, m.expert_ffn_size // etp
        per_slot = (3 + (lay.ep > 1)) * h + 2 * (mlp - 1) * f
        inside += D * tokens * k * per_slot + 12 * tokens * m.num_experts
    if m.multi_latent_attention:
        return outside + inside + attention
    return outside + inside + (_attention_core_bytes(m, lay, t, dev) if core else 0)


def layer_input_bytes(m: ModelConfig, lay: Layout, t: Training) -> int:
    """One (b, s, h) activation between layers (b, s / t, h with SP)."""
    sp = lay.tp if lay.sequence_parallel else 1
    return t.dtype_bytes * m.seq_length * lay.micro_batch * m.hidden_size // sp


def embedding_extra_bytes(m: ModelConfig, lay: Layout, dev: Device) -> int:
    """First virtual stage: token and position ids, the embedding's dropout mask."""
    s, b = m.seq_length, lay.micro_batch
    sp = lay.tp if lay.sequence_parallel else 1
    mask = dev.mask_bytes * s * b * m.hidden_size // sp if m.hidden_dropout > 0 else 0
    return 8 * s * b + 8 * s + mask


def head_extra_bytes(m: ModelConfig, lay: Layout, t: Training) -> int:
    """Last virtual stage: the final norm's input and output and statistics, the fp32 logits
    the vocab-parallel loss keeps (s b V / t), the labels and the loss mask; with
    --cross-entropy-fusion-impl linear an fp32 log-sum-exp per token instead of the logits."""
    s, b, tp = m.seq_length, lay.micro_batch, lay.tp
    sp = tp if lay.sequence_parallel else 1
    norm = 2 * layer_input_bytes(m, lay, t) + 8 * s * b // sp
    if t.cross_entropy_fusion_impl == "linear":
        return norm + 4 * s * b + 8 * s * b  # the log-sum-exp, the labels
    logits = 4 * s * b * m.padded_vocab_size(tp) // tp
    return norm + logits + 17 * s * b


def chunk_activation_bytes(
    m: ModelConfig, lay: Layout, t: Training, dev: Device, first: bool, last: bool
) -> tuple[int, int]:
    """(kept until backward, extra working set while its backward runs) for one micro batch of
    one model chunk of L / (P V) layers; `first` / `last`: the first / last virtual stage."""
    n = m.num_layers // (lay.pp * (lay.vp or 1))
    core = lay.recompute != "selective"
    full = layer_activation_bytes(m, lay, t, dev, core=core)
    if m.moe:  # the mean over the chunk's layers, MoE ones at the model's proportion
        moe = layer_activation_bytes(m, lay, t, dev, core=core, moe=True)
        full = (full * (m.num_layers - m.moe_layers) + moe * m.moe_layers) // m.num_layers
    kept, working = n * full, 0
    if lay.recompute == "full":
        k = min(t.recompute_num_layers, n)
        x = layer_input_bytes(m, lay, t)
        if t.recompute_method == "uniform":  # groups of k layers: their inputs; one rebuilt
            kept, working = -(-n // k) * x, k * full
        else:  # block: the first k layers each keep their input only
            kept, working = k * x + (n - k) * full, full
    extra = (embedding_extra_bytes(m, lay, dev) if first else 0) + (
        head_extra_bytes(m, lay, t) + mtp_activation_bytes(m, lay, t, dev) if last else 0
    )
    return kept + extra, working


def mtp_activation_bytes(m: ModelConfig, lay: Layout, t: Training, dev: Device) -> int:
    """The --mtp-num-layers depths (last virtual stage): each its layer's, its head's and the
    norms' and projection's inputs (the embedding, two normed inputs of 2 h, the gathered
    projection output)."""
    if not m.mtp_num_layers:
        return 0
    core = lay.recompute != "selective"
    moe = m.is_moe_layer(m.num_layers - 1)
    layer = layer_activation_bytes(m, lay, t, dev, core=core, moe=moe)
    inputs = 5 * layer_input_bytes(m, lay, t)
    return m.mtp_num_layers * (layer + head_extra_bytes(m, lay, t) + inputs)


def per_rank_sequence(m: ModelConfig, lay: Layout) -> ModelConfig:
    """The model as one rank's activations see it: s / CP tokens of each sequence."""
    if lay.cp == 1:
        return m
    return dataclasses.replace(m, seq_length=m.seq_length // lay.cp)


def replace(lay: Layout, **changes) -> Layout:
    return dataclasses.replace(lay, **changes)
