"""Activation bytes of a pipeline stage over one step, walked in its schedule's own order, and
the whole rank's memory (megatron/planning/memory.py models one micro batch of one chunk).

A stage's `activations` term is the peak, over its action list (megatron.schedules), of
the bytes held for backward: each micro batch of each chunk from its F to its B; with a
zero-bubble schedule, from the B to the W only what the W reads (the queue of
megatron.mpu.weight_grad, `weight_grad_bytes`). It is what megatron.model.memory.LiveActivations
measures during a real step (tests/planning/test_pipeline_memory.py holds the two within 5%
for every schedule at PP 2 and 4): every storage autograd saves, once, plus the W queue's.
Besides it: `recompute_working` (full recompute rebuilding one group in B, on top of the
peak) and `p2p_buffers` (the forward outputs sent on and kept until their backward).
"""

from __future__ import annotations

from megatron.config.schema import ModelConfig
from megatron.planning.memory import (
    Device,
    Layout,
    MemoryEstimate,
    Training,
    chunk_activation_bytes,
    layer_input_bytes,
    model_state_bytes,
    per_rank_sequence,
    stage_expert_params,
    stage_params,
)

_DEVICE = Device()  # the default: CUDA's, no overhead


def layer_weight_grad_bytes(m: ModelConfig, lay: Layout, t: Training, moe: bool = False) -> int:
    """What one layer's deferred W's hold after its B, one micro batch: per linear its input
    and its output gradient (megatron.mpu.weight_grad). Column-parallel inputs are the whole
    (b, s, h) under sequence parallelism (the gathered copy the W reads); row-parallel output
    gradients are (b, s, h) too. An MoE layer: its experts' permuted tokens and inner
    activations with their gradients per (token, expert) slot, its shared expert's as an MLP's
    (the router's fp32 linear takes its gradient in B)."""
    s, b, h, D, tp = m.seq_length, lay.micro_batch, m.hidden_size, t.dtype_bytes, lay.tp
    hd, gated = m.head_dim, 2 if m.swiglu else 1
    qkv, ctx = (m.num_attention_heads + 2 * m.query_groups) * hd, m.num_attention_heads * hd
    # attention: qkv (input h, grad qkv / t), dense (input ctx / t, grad h)
    attention = 2 * h + (qkv + ctx) // tp
    ffn = (m.moe_shared_expert_intermediate_size or 0) if moe else m.ffn_size
    # an MLP of width f: fc1 (input h, grad gated f / t), fc2 (input f / t, grad h)
    mlp = 2 * h + (gated + 1) * ffn // tp if ffn else 0
    bytes_ = D * s * b * (attention + mlp)
    if moe:
        etp = lay.expert_tp
        tokens = s * b // (tp if lay.sequence_parallel and etp == 1 else 1)
        f = m.expert_ffn_size // etp
        bytes_ += D * tokens * m.moe_router_topk * (2 * h + (gated + 1) * f)
    return bytes_


def weight_grad_bytes(m: ModelConfig, lay: Layout, t: Training, first: bool, last: bool) -> int:
    """A chunk's W queue for one micro batch (`first` / `last`: the first / last virtual
    stage): its layers', the embedding's (the ids and the output gradient) and the head's (the
    final norm's output and the logits' gradient, s b V / t; none with the fused linear
    cross-entropy, whose kernel gives both gradients in B). Multi-latent attention's and
    multi-token prediction's W's are counted as their layers' whole activations (an upper
    bound: planning/memory.py)."""
    n = m.num_layers // (lay.pp * (lay.vp or 1))
    dense = layer_weight_grad_bytes(m, lay, t)
    if m.moe:  # the mean over the chunk's layers, as chunk_activation_bytes
        moe = layer_weight_grad_bytes(m, lay, t, moe=True)
        dense = (dense * (m.num_layers - m.moe_layers) + moe * m.moe_layers) // m.num_layers
    s, b, D = m.seq_length, lay.micro_batch, t.dtype_bytes
    out = n * dense
    if first:
        out += 8 * s * b + layer_input_bytes(m, lay, t) * (lay.tp if lay.sequence_parallel else 1)
    if last and t.cross_entropy_fusion_impl != "linear":
        full = D * s * b * m.hidden_size
        out += full + D * s * b * m.padded_vocab_size(lay.tp) // lay.tp
    return out


def _chunk_sizes(m, lay, t, dev, stage) -> dict[int, tuple[int, int, int]]:
    """Per chunk c of the stage: (kept from F to B, recompute working set, held B to W)."""
    P, schedule = lay.pp, lay.pipeline
    V = schedule.chunks_per_stage(lay.vp)
    sizes = {}
    for c in range(V):
        virtual = schedule.virtual_stage(P, stage, c)
        first, last = virtual == 0, virtual == P * V - 1
        kept, working = chunk_activation_bytes(m, lay, t, dev, first, last)
        held = kept
        if not m.multi_latent_attention and not (last and m.mtp_num_layers):
            held = weight_grad_bytes(m, lay, t, first, last)
        sizes[c] = (kept, working, held)
    return sizes


def stage_activation_peak(
    m: ModelConfig, lay: Layout, t: Training, dev: Device, stage: int
) -> dict[str, int]:
    """Peak bytes of a stage over one step: activations held for backward (all micro batches
    in flight), the recompute working set on top, the pipeline's output buffers. The stage's
    action list is walked as the schedule runs it: a micro batch's activations leave at its
    B; where a W of its own follows (zero-bubble), the B leaves what the W reads
    (weight_grad_bytes: under full recompute more than the group inputs kept, since the B
    rebuilt them) and the W frees that. A zero-bubble schedule's full backward (DualPipeV's)
    queues the same and runs it right after: held at the end of that B."""
    P, schedule = lay.pp, lay.pipeline
    V = schedule.chunks_per_stage(lay.vp)
    sizes = _chunk_sizes(m, lay, t, dev, stage)
    if P == 1:  # gradient accumulation: one micro batch at a time
        kept, working, _ = sizes[0]
        return {"activations": kept, "recompute_working": working, "p2p_buffers": 0}
    live, peak, with_working, outputs, peak_out = 0, 0, 0, 0, 0
    out_bytes = layer_input_bytes(m, lay, t)
    # After the warm-up the live set repeats every P micro batches: 4P of them show the peak.
    M = min(lay.num_micro_batches, 4 * P)
    actions = schedule.actions(P, stage, M, V)
    split = {(c, mb) for kind, c, mb in actions if kind == "W"}
    queued = schedule.split_backward  # every B queues its W's, a full one runs them after
    for kind, c, mb in actions:
        kept, working, held = sizes[c]
        last = schedule.virtual_stage(P, stage, c) == P * V - 1
        if kind == "F":
            live += kept
            outputs += 0 if last else out_bytes
            peak_out = max(peak_out, outputs)
        elif kind == "B":
            with_working = max(with_working, live + working)
            # the gradient received is queued (the last linear's output gradient) before
            # the chunk frees anything
            peak = max(peak, live + (out_bytes if queued and not last else 0))
            live += held - kept if queued else -kept
            peak = max(peak, live)
            live -= 0 if (c, mb) in split or not queued else held
            outputs -= 0 if last else out_bytes
        else:
            live -= held
        peak = max(peak, live)
    working = max(0, with_working - peak)
    return {"activations": peak, "recompute_working": working, "p2p_buffers": peak_out}


def stage_memory(
    m: ModelConfig, lay: Layout, t: Training, dev: Device, stage: int
) -> dict[str, int]:
    """Every term of one pipeline stage's rank, in bytes."""
    params = stage_params(m, lay.tp, lay.pp, stage, lay.ep, lay.expert_tp, lay.v_shape)
    experts = stage_expert_params(m, lay.pp, stage, lay.ep, lay.expert_tp)
    terms = model_state_bytes(params, lay.dp * lay.cp, t, experts, lay.ep)
    terms.update(stage_activation_peak(per_rank_sequence(m, lay), lay, t, dev, stage))
    terms["overhead"] = dev.overhead_bytes
    return terms


def estimate_memory(
    m: ModelConfig, lay: Layout, t: Training, dev: Device = _DEVICE
) -> MemoryEstimate:
    """The fullest rank of the layout (the pipeline stage with the largest total)."""
    # Middle stages hold fewer micro batches than the first and no embedding or head.
    stages = [MemoryEstimate(s, stage_memory(m, lay, t, dev, s)) for s in {0, lay.pp - 1}]
    return max(stages, key=lambda e: e.total)
