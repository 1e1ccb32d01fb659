"""Seconds per training step of a layout, term by term.

    compute     M x (forward + backward FLOPs of the slowest stage's chunks) / (peak x eff);
                forward = 2 x tokens x (matmul weights) + 4 b s^2 a d (scores and context);
                backward = 2 x forward
    recompute   full: one more forward of the layers; selective: of the attention core
    tp_comm     per layer and micro batch 4 all-reduces of b s h x D bytes (6 with full
                recompute; SP's all-gather + reduce-scatter move the same bytes), each
                2 (t-1)/t x bytes / bandwidth (intra-node while t <= GPUs per node)
    bubble      (compute + recompute + tp_comm) x (P - 1) / (V M)
    pp_p2p      2 V M messages of b s h x D bytes (s / t with SP) between neighbouring stages
    dp_comm     the fp32 gradient all-reduce 2 (d-1)/d x 4 N bytes over DP, minus the part
                hidden behind the last micro batch's backward (buckets launch during it)
    cp_comm     context parallelism: per layer and micro batch the ring sends CP - 1 K/V
                blocks forward, CP - 1 K/V and CP fp32 dK/dV blocks backward (b s / CP x
                2 g d / t each); each step's message is hidden behind the attention of the
                block in hand, only the excess counts (cp_ring_seconds has the whole volume)
    ep_comm     MoE: per MoE layer and micro batch, the token dispatch and combine all-to-alls
                (2 forward, 2 backward, 2 more with full recompute) of the T k h x D bytes a
                rank routes, (EP-1)/EP of them leaving the rank (over the DP links). With
                DualPipeV (EP > 1) each overlapped pair of a forward and a backward
                (PipelineSchedule.overlapped_pairs, megatron.schedules; the stage with fewest)
                hides the forward's all-to-alls behind the backward's compute and the
                backward's behind the forward's, each up to the other's compute
    launch      M x layers x a fixed cost per layer forward + backward (kernel launches,
                framework overhead): what makes tiny micro batches slow
    optimizer   reading and writing weights, gradients and Adam state (memory-bound)

An MoE layer counts its active weights (router, k experts, shared expert): balanced, every EP
rank computes T k tokens' experts; without SP each TP rank routes (and computes) every token.

With CP every rank computes 1 / CP of each layer (s / CP tokens; a causal-balanced 1 / CP of
the attention core), its TP and pipeline messages are 1 / CP as large, and the gradient
all-reduce runs over DP x CP.

MFU = model FLOPs (3 x forward, no recompute) / (step time x world x peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.schema import ModelConfig
from megatron.planning import mla
from megatron.planning.memory import (
    Layout,
    Training,
    layer_params,
    mlp_params,
    norm_params,
    stage_expert_params,
    stage_params,
)
from megatron.schedules.sim import simulate


@dataclass(frozen=True)
class Hardware:
    """Device and network. Bandwidths in GB/s per GPU (bus bandwidth of a ring collective);
    `latency_s` is added once per collective or message (large on CPU gloo)."""

    peak_tflops: float = 312.0  # A100 bf16 dense
    matmul_efficiency: float = 0.55
    intra_node_gbps: float = 240.0  # NVLink (A100: 300 GB/s unidirectional, ~80% as bus bw)
    inter_node_gbps: float = 23.0  # 200 Gb/s InfiniBand per GPU, ~90%
    memory_gbps: float = 1500.0  # HBM
    gpus_per_node: int = 8
    latency_s: float = 10e-6
    layer_overhead_s: float = 100e-6  # kernel launches etc. of one layer's forward + backward

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.matmul_efficiency


def layer_forward_flops(m: ModelConfig, micro_batch: int) -> tuple[float, float]:
    """(matmul FLOPs, attention-core FLOPs) of one layer's forward on one micro batch (all TP
    ranks together); with MoE the mean over the layers of their active weights, with windows
    (--window-size) the mean over the layers of the keys each query scores."""
    tokens = micro_batch * m.seq_length
    weights = layer_params(m, 1) - 2 * norm_params(m)  # the matmul weights (biases ~ 0)
    if m.moe:
        active = layer_params(m, 1, moe=True) - 2 * norm_params(m) + expert_flops_weights(m)
        weights = (weights * (m.num_layers - m.moe_layers) + active * m.moe_layers) / m.num_layers
    core = 4 * micro_batch * m.seq_length**2 * m.num_attention_heads * m.head_dim
    if m.multi_latent_attention:
        core = mla.core_flops(m, micro_batch)
    if m.window is not None:  # windowed layers score LEFT + 1 keys per query, not s
        spans = m.keys_per_query(m.seq_length)
        core = core * sum(spans) / (len(spans) * m.seq_length)
    return 2.0 * tokens * weights, float(core)


def expert_flops_weights(m: ModelConfig) -> int:
    """The expert weights one token goes through in an MoE layer (k experts)."""
    return m.moe_router_topk * mlp_params(m, m.expert_ffn_size, 1)


def moe_seconds(m: ModelConfig, lay: Layout, t: Training, hw: Hardware) -> dict[str, float]:
    """Per micro batch on one stage: "redundant" (the expert compute TP ranks repeat at ETP 1
    without SP: they all route every token) and "all_to_all" (dispatch + combine, forward +
    backward; at ETP = TP every TP rank dispatches the TP group's tokens)."""
    P = lay.pp
    moe_layers = max(m.moe_layers * 1.0 / P, 0.0) if m.moe else 0.0
    if not moe_layers:
        return {"redundant": 0.0, "all_to_all": 0.0}
    tokens = lay.micro_batch * m.seq_length / lay.cp
    sp = lay.tp if lay.sequence_parallel else 1
    expert = 2.0 * tokens * expert_flops_weights(m)  # forward FLOPs of one layer's experts
    redundant = 0.0 if sp > 1 or lay.expert_tp > 1 else 3 * expert * (1 - 1 / lay.tp)
    redundant /= hw.flops_per_s
    sp = sp if lay.expert_tp == 1 else 1
    ep = lay.ep
    calls = 6 if lay.recompute == "full" else 4
    ranks = lay.tp * ep  # an EP group: EP consecutive DP x CP ranks, TP apart in the grid
    gbps = hw.intra_node_gbps if ranks <= hw.gpus_per_node else hw.inter_node_gbps
    volume = t.dtype_bytes * tokens / sp * m.moe_router_topk * m.hidden_size * (ep - 1) / ep
    a2a = 0.0 if ep == 1 else calls * (volume / (gbps * 1e9) + hw.latency_s)
    return {"redundant": moe_layers * redundant, "all_to_all": moe_layers * a2a}


def model_flops(m: ModelConfig, global_batch: int) -> float:
    """Forward + backward FLOPs of one step, no recompute (the MFU numerator)."""
    mat, core = layer_forward_flops(m, global_batch)
    head = 2.0 * global_batch * m.seq_length * m.hidden_size * m.padded_vocab_size(1)
    return 3.0 * (m.num_layers * (mat + core) + head)


def _ring(bytes_: float, n: int, gbps: float, latency: float) -> float:
    """A ring all-reduce of `bytes_` over n ranks."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * bytes_ / (gbps * 1e9) + latency


def cp_ring_seconds(m: ModelConfig, lay: Layout, t: Training, hw: Hardware) -> dict[str, float]:
    """The ring of one layer and micro batch: "messages" (its whole send time, forward and
    backward) and "exposed" (what the block computations do not hide)."""
    cp, tp = lay.cp, lay.tp
    if cp == 1:
        return {"messages": 0.0, "exposed": 0.0}
    gbps = hw.intra_node_gbps if tp * cp <= hw.gpus_per_node else hw.inter_node_gbps
    width = mla.ring_kv_width(m) if m.multi_latent_attention else 2 * m.query_groups * m.head_dim
    block = lay.micro_batch * m.seq_length // cp * width // tp
    kv = t.dtype_bytes * block / (gbps * 1e9) + hw.latency_s
    dkv = 4 * block / (gbps * 1e9) + hw.latency_s
    step_fwd = layer_forward_flops(m, lay.micro_batch)[1] / (tp * cp * cp) / hw.flops_per_s
    whole = (cp - 1) * 2 * kv + cp * dkv
    exposed = (cp - 1) * (max(0.0, kv - step_fwd) + max(0.0, kv - 2 * step_fwd))
    return {"messages": whole, "exposed": exposed + cp * max(0.0, dkv - 2 * step_fwd)}


def step_time(m: ModelConfig, lay: Layout, t: Training, hw: Hardware) -> dict[str, float]:
    """Every term of one step, in seconds (see the module docstring)."""
    P, V, M, tp, cp = lay.pp, lay.vp or 1, lay.num_micro_batches, lay.tp, lay.cp
    layers = m.num_layers // P
    mat, core = layer_forward_flops(m, lay.micro_batch)
    head = 2.0 * lay.micro_batch * m.seq_length * m.hidden_size * m.padded_vocab_size(1)
    fwd = (layers * (mat + core) + head) / (tp * cp)  # the last stage: the slowest one
    compute = M * 3 * fwd / hw.flops_per_s
    extra = {"full": layers * (mat + core), "selective": layers * core}.get(lay.recompute, 0.0)
    recompute = M * extra / (tp * cp) / hw.flops_per_s
    intra = tp <= hw.gpus_per_node
    bw = hw.intra_node_gbps if intra else hw.inter_node_gbps
    act = t.dtype_bytes * lay.micro_batch * m.seq_length * m.hidden_size / cp
    calls = 6 if lay.recompute == "full" else 4
    launch = M * layers * hw.layer_overhead_s * (4 / 3 if lay.recompute == "full" else 1)
    tp_comm = M * layers * calls * _ring(act, tp, bw, hw.latency_s)
    cp_comm = M * layers * cp_ring_seconds(m, lay, t, hw)["exposed"]
    if lay.recompute == "full":  # the recomputed forward rings K/V once more
        cp_comm *= 4 / 3
    moe = moe_seconds(m, lay, t, hw)
    compute += M * moe["redundant"]
    ep_comm = M * moe["all_to_all"]
    if lay.pipeline.overlaps_moe_pairs(lay.pp, lay.ep):
        ep_comm -= hidden_all_to_all(lay, moe["all_to_all"], 3 * fwd / hw.flops_per_s)
    busy = compute + recompute + launch + tp_comm + cp_comm + ep_comm
    bubble = busy * idle_per_work(lay)
    ranks = tp * cp * lay.dp * P
    p2p_gbps = hw.intra_node_gbps if ranks <= hw.gpus_per_node else hw.inter_node_gbps
    sp = tp if lay.sequence_parallel else 1
    pp_p2p = 0.0 if P == 1 else 2 * V * M * (act / sp / (p2p_gbps * 1e9) + hw.latency_s)
    etp = lay.expert_tp
    params = max(stage_params(m, tp, P, s, lay.ep, etp, lay.v_shape) for s in {0, P - 1})
    experts = max(stage_expert_params(m, P, s, lay.ep, etp) for s in {0, P - 1})
    dp_gbps = hw.intra_node_gbps if tp * cp * lay.dp <= hw.gpus_per_node else hw.inter_node_gbps
    dp_full = _ring(4.0 * (params - experts), lay.dp * cp, dp_gbps, hw.latency_s)
    dp_full += _ring(4.0 * experts, lay.dp * cp // lay.ep, dp_gbps, hw.latency_s)
    hidden = (compute + recompute) / M * 2 / 3  # the last micro batch's backward
    optimizer = params * (t.dtype_bytes + 4 + 24) / (hw.memory_gbps * 1e9)
    return {
        "compute": compute,
        "recompute": recompute,
        "launch": launch,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "ep_comm": ep_comm,
        "bubble": bubble,
        "pp_p2p": pp_p2p,
        "dp_comm": max(0.0, dp_full - hidden),
        "optimizer": optimizer,
    }


def hidden_all_to_all(lay: Layout, per_micro_batch: float, compute: float) -> float:
    """Seconds of a stage's all-to-alls its overlapped pairs hide: per pair the forward's
    share (2 of the calls) up to the backward's compute (2/3 of a micro batch's), the
    backward's share up to the forward's (1/3). `per_micro_batch`, `compute`: one micro
    batch's all-to-all and forward + backward seconds."""
    P, M, schedule = lay.pp, lay.num_micro_batches, lay.pipeline
    pairs = min(
        len(schedule.overlapped_pairs(schedule.actions(P, s, M, 2), s == P - 1)) for s in range(P)
    )
    forward_share = per_micro_batch * 2 / (6 if lay.recompute == "full" else 4)
    backward_share = per_micro_batch - forward_share
    per_pair = min(forward_share, compute * 2 / 3) + min(backward_share, compute / 3)
    return pairs * per_pair


def idle_per_work(lay: Layout) -> float:
    """A stage's idle time per unit of its own work: (P - 1) / (V M) for the schedules whose
    backward is whole (1F1B, interleaved); the zero-bubble schedules' lists run by the
    simulator (megatron.schedules.sim) with a backward twice the forward, split evenly into B
    and W (DualPipeV's pairs overlapped as the runtime overlaps them, the planner assuming the
    alltoall dispatcher)."""
    P, M, schedule = lay.pp, lay.num_micro_batches, lay.pipeline
    if not schedule.split_backward or P == 1:
        return (P - 1) / ((lay.vp or 1) * M)
    overlap = schedule.overlaps_moe_pairs(P, lay.ep)
    run = simulate(schedule, P, M, schedule.fixed_chunks, overlap=overlap)
    return (run.step_time - run.busy[0]) / run.busy[0]


def mfu(m: ModelConfig, global_batch: int, seconds: float, world: int, hw: Hardware) -> float:
    return model_flops(m, global_batch) / (seconds * world * hw.peak_tflops * 1e12)


def limiting_term(terms: dict[str, float]) -> str:
    """The largest cost besides the model's own compute."""
    return max((k for k in terms if k != "compute"), key=lambda k: terms[k])
