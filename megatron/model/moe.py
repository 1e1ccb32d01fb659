"""Mixture of experts: a top-k router and E expert MLPs in place of a layer's MLP.

    y = shared(x) + sum_{e in topk(x)} p_e(x) expert_e(x)

Tokens are the rows of x (b, s, h) -> (T, h). The router's logits x W_r^T (T, E) and every
score are fp32. Each expert is the model's MLP (GeLU, or SwiGLU with [gate; up] in one weight),
its weights stacked over experts: weight1 (E, h, F1), weight2 (E, F, h).

Expert parallelism (`state.ep_size` EP > 1): EP rank e holds experts [e E/EP, (e+1) E/EP) (the
stacked weights' dim 0 is split over the EP group, `expert_parallel`; EP groups are carved from
the DP x CP ranks, mpu/parallel_state.py). The alltoall dispatcher sends each (token, expert)
assignment to the rank of its expert and the outputs back (forward: two all-to-alls;
backward: the two reverse ones); the allgather dispatcher gathers every EP
rank's tokens on every rank and reduce-scatters the outputs.

Expert tensor parallelism (`state.etp_size`, 1 or TP). ETP = TP: each expert's FFN is split over
the TP group as the dense MLP is (weight1's columns, [gate_r; up_r] under SwiGLU, and bias1
column-parallel, weight2's rows row-parallel, bias2 whole, added after the sum over TP). Every
TP rank dispatches the same tokens (with --sequence-parallel each rank routes its own s / TP
tokens, then the TP group's tokens and routing are all-gathered, and the layer's output is cut
back to this rank's positions); the experts sum their partial outputs over TP. Their gradients
are whole on every TP rank, reduced over the expert-data-parallel group only. ETP = 1: experts
replicated over TP (Megatron-core's --expert-tensor-parallel-size 1); with --sequence-parallel
each TP rank routes and computes its own s / TP tokens and the expert and router gradients are
summed over TP like the norms' (`sequence_parallel` marks, model/parallelize.py).

The router (scores, top-k, groups, expert bias, capacity, aux and z losses) is
megatron.model.router. The losses reach backward without passing through the model's output:
`_AttachLoss` gives them the gradient `loss_grad_scale` (1 / micro batches x the fp16 loss
scale x CP, set by the trainer through `set_moe_loss_scale`), as the LM loss gets. Capacity is
per rank, over its own tokens (as in Megatron-core), so with CP or SP it is not the one-process
capacity. Their values and the tokens per expert are recorded in backward (once per micro
batch, also under activation recompute) in `MoEStats`; after the optimizer step
`moe_step_stats` sums them over every rank, and those global tokens per expert move the expert
biases (`update_expert_bias`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.mlp import ParallelMLP
from megatron.model.router import Router
from megatron.mpu.mappings import (
    all_gather_rows,
    all_gather_sequence,
    all_to_all,
    copy_to_tensor_model_parallel_region,
    exchange_counts,
    gather_from_expert_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_expert_region,
    scatter_to_sequence_parallel_region,
)
from megatron.mpu.utils import divide, group_size


class MoEStats:
    """What one MoE layer saw since the last read: summed aux and z losses (each with its
    coefficient), micro batches, and tokens routed per expert (this rank's, dropped ones
    excluded). Recorded in backward, read and reset by training/log.py."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.values: torch.Tensor | None = None  # [aux, z, micro batches, tokens per expert...]

    def add(self, aux: torch.Tensor, z: torch.Tensor, counts: torch.Tensor) -> None:
        one = torch.ones((), device=counts.device)
        row = torch.cat([torch.stack([aux.float(), z.float(), one]), counts.float()])
        self.values = row if self.values is None else self.values + row


class _AttachLoss(torch.autograd.Function):
    """Forward: y = x. Backward: x gets y's gradient, `loss` gets `scale` (the gradient the
    LM loss gets from the trainer's scaling), so d loss / d weights joins the backward pass."""

    @staticmethod
    def forward(ctx, x, loss, scale, stats, record):
        ctx.scale, ctx.stats, ctx.record = scale, stats, record
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.stats is not None:
            ctx.stats.add(*ctx.record)
        loss_grad = torch.full((), ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, loss_grad, None, None, None


class Experts(nn.Module):
    """This EP rank's E / EP experts (their FFN split over ETP): tokens (N, h) sorted by expert,
    `counts` per expert -> (N, h). `grouped`: one grouped matmul per projection
    (torch._grouped_mm where the shapes allow it, else a batched matmul over the groups padded
    to the largest); else a loop."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, grouped: bool):
        super().__init__()
        self.local = divide(cfg.num_experts, ctx.state.ep_size)
        etp = ctx.state.etp_size
        self.etp_group = ctx.state.etp_group
        h, f = cfg.hidden_size, divide(cfg.expert_ffn_size, etp)
        self.swiglu, self.grouped, self.ops = cfg.swiglu, grouped, ctx.ops
        self.weight_grad_split = None  # a WeightGradSplit: deferrable weight gradients
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        f1 = 2 * f if cfg.swiglu else f  # SwiGLU: [gate; up] (this ETP rank's [gate_r; up_r])
        stride1 = 2 if cfg.swiglu else 1
        kw = {"device": ctx.device, "dtype": ctx.dtype}
        self.weight1 = nn.Parameter(torch.empty(self.local, h, f1, **kw))
        self.weight2 = nn.Parameter(torch.empty(self.local, f, h, **kw))
        splits = {"weight1": (2, stride1), "weight2": (1, 1)}
        self.bias1 = self.bias2 = None
        if cfg.add_bias_linear:
            self.bias1 = nn.Parameter(torch.empty(self.local, f1, **kw))
            self.bias2 = nn.Parameter(torch.empty(self.local, h, **kw))
            splits["bias1"] = (1, stride1)
        for name, p in self.named_parameters():
            mark_expert(p, splits.get(name), etp)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        x = copy_to_tensor_model_parallel_region(x, self.etp_group)
        split = self.weight_grad_split  # zero-bubble (megatron.mpu.weight_grad): for a W
        if self.grouped or split is not None:
            matmul = grouped_matmul if self.grouped else looped_matmul
            y = _grouped(x, self.weight1, counts, matmul, split)
            y = self._activation(_add_bias(y, self.bias1, counts))
            y = _grouped(y, self.weight2, counts, matmul, split)
        else:
            outs = [self._mlp(t, e) for e, t in enumerate(torch.split(x, counts))]
            y = torch.cat(outs) if outs else x
        y = reduce_from_tensor_model_parallel_region(y, self.etp_group)  # the ETP shards' sum
        return _add_bias(y, self.bias2, counts)

    def _mlp(self, x: torch.Tensor, e: int) -> torch.Tensor:
        y = x @ self.weight1[e]
        y = self._activation(y if self.bias1 is None else y + self.bias1[e])
        return y @ self.weight2[e]

    def _activation(self, y: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.ops.swiglu_act(y)  # [gate; up] -> silu(gate) * up
        return F.gelu(y, approximate=self.gelu_approx)


def _grouped(x, w, counts: list[int], matmul, split) -> torch.Tensor:
    if split is not None:
        return split.grouped_matmul(x, w, counts, matmul)
    return matmul(x, w, counts)


def looped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """grouped_matmul as one matmul per group (the experts' loop without --moe-grouped-gemm)."""
    outs = [t @ w[g] for g, t in enumerate(torch.split(x, counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.size(2))


def mark_expert(param: torch.Tensor, split: tuple[int, int] | None, etp: int) -> None:
    """An expert tensor: dim 0 (the stacked experts) split over EP (`expert_parallel`);
    `expert_partition` (dim, stride) how its whole tensor is cut over ETP (None: not cut, as
    bias2), `expert_tensor_parallel` whether this run cuts it (ETP > 1), so each TP rank holds
    a different shard (megatron.checkpoint.experts)."""
    param.expert_parallel = True
    param.expert_partition = split
    param.expert_tensor_parallel = split is not None and etp > 1


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
    if bias is None:
        return y
    sizes = torch.tensor(counts, device=y.device)
    return y + bias.repeat_interleave(sizes, dim=0, output_size=y.size(0))


def grouped_gemm_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """How --moe-grouped-gemm multiplies on `device` in `dtype`: "torch._grouped_mm" or
    "padded bmm". On CUDA torch._grouped_mm has a fused kernel for bf16 on sm90 / sm100 only
    (elsewhere some torch versions refuse it, others loop over the groups with a host sync),
    so other CUDA cases take the padded bmm; on the CPU it runs for every dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return "padded bmm"
    device = torch.device(device)
    if device.type == "cuda":
        fused = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
        return "torch._grouped_mm" if fused else "padded bmm"
    return "torch._grouped_mm" if device.type == "cpu" else "padded bmm"


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm on this device and dtype (grouped_gemm_path), with row strides that
    are multiples of 16 bytes."""
    if x.dtype != w.dtype or grouped_gemm_path(x.device, x.dtype) != "torch._grouped_mm":
        return False
    size = x.element_size()
    return (x.size(1) * size) % 16 == 0 and (w.size(2) * size) % 16 == 0


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of x in groups of `counts`, group g times w[g]: (N, a) x (G, a, c) -> (N, c)."""
    if x.size(0) == 0:  # no tokens reached these experts
        return x.new_zeros(0, w.size(2))
    if _grouped_mm_fits(x, w):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x.contiguous(), w, offs=offsets)
        if y.requires_grad:  # its backward needs a dense gradient
            y.register_hook(lambda g: g.contiguous())
        return y
    return padded_bmm(x, w, counts)


def padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The grouped product as one bmm: groups padded with zero rows to the largest."""
    groups, longest = len(counts), max(counts)
    sizes = torch.tensor(counts, device=x.device)
    group_of = torch.repeat_interleave(torch.arange(groups, device=x.device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    slot = group_of * longest + torch.arange(x.size(0), device=x.device) - starts[group_of]
    padded = x.new_zeros(groups * longest, x.size(1)).index_copy(0, slot, x)
    y = torch.bmm(padded.view(groups, longest, -1), w)  # (G, longest, c)
    return y.reshape(groups * longest, -1)[slot]


class MoELayer(nn.Module):
    """Router + experts (+ shared expert) in place of ParallelMLP: (b, s, h) -> (b, s, h)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.cfg, self.state = cfg, ctx.state
        self.dispatcher = ctx.moe_dispatcher
        self.router = Router(cfg, ctx)
        self.experts = Experts(cfg, ctx, ctx.moe_grouped_gemm)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.moe_shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(
                cfg, ffn_hidden_size=cfg.moe_shared_expert_intermediate_size
            )
            self.shared_expert = ParallelMLP(shared, ctx)
            self.shared_expert.defer_bias = False  # its output is complete
            if cfg.moe_shared_expert_gate:
                self.shared_expert_gate = nn.Linear(
                    cfg.hidden_size, 1, bias=False, device=ctx.device, dtype=ctx.dtype
                )
        self.loss_grad_scale = 1.0  # set_moe_loss_scale
        # called between launching each token all-to-all and waiting for it (megatron.mpu.
        # mappings.all_to_all): DualPipeV's pair overlap hands it over (megatron.mpu.overlap)
        self.hand_over = None
        self.stats = MoEStats(cfg.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)  # (T, h)
        probs, experts, keep, aux, z, counts = self.router(tokens, b)
        routed = (x, probs, experts, keep)
        gather = self.state.sequence_parallel and self.state.etp_size > 1
        if gather:  # the TP group's tokens and routing on every TP rank (ETP splits the FFN)
            routed = _gather_routing(*routed, self.state.tp_group)
        out = self._routed_experts(*routed)
        if gather:  # this rank's s / TP positions (backward: the gradient all-gathered)
            out = scatter_to_sequence_parallel_region(out, self.state.tp_group)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.training and out.requires_grad:  # the losses' gradient, the stats in backward
            record = (aux.detach(), z.detach(), counts)
            out = _AttachLoss.apply(out, aux + z, self.loss_grad_scale, self.stats, record)
        return out

    def _routed_experts(self, x, probs, experts, keep) -> torch.Tensor:
        """x (b, s, h) routed -> sum over its kept assignments of p x expert output."""
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        if self.dispatcher == "allgather" and group_size(self.state.ep_group) > 1:
            per_slot = self._allgather(tokens, experts, keep)
        else:
            per_slot = self._alltoall(tokens, experts, keep)
        return (per_slot * probs.unsqueeze(-1).to(per_slot.dtype)).sum(1).view(b, s, h)

    def _alltoall(self, tokens, experts, keep) -> torch.Tensor:
        """(T, h) -> (T, k, h): each kept assignment's expert output (zeros where dropped)."""
        t, k = experts.shape
        e, ep, group = self.cfg.num_experts, self.state.ep_size, self.state.ep_group
        slots = torch.nonzero(keep.reshape(-1)).squeeze(1)  # kept assignments, token-major
        ids = experts.reshape(-1)[slots]
        order = torch.argsort(ids, stable=True)
        slots, ids = slots[order], ids[order]
        counts = torch.bincount(ids, minlength=e)  # (E,) this rank's assignments per expert
        sent = tokens[slots // k]  # (N, h) sorted by expert, hence by destination EP rank
        if ep > 1:  # received[j, l]: tokens EP rank j sends to my local expert l
            received = exchange_counts(counts, group)  # (EP, E / EP)
            in_splits = counts.view(ep, -1).sum(1).tolist()
            out_splits = received.sum(1).tolist()
            # in (source, expert) order
            arrived = all_to_all(sent, group, out_splits, in_splits, self.hand_over)
            by_expert = _source_major_to_expert_major(received)
            y = self.experts(arrived[by_expert], received.sum(0).tolist())
            back = torch.argsort(by_expert)  # expert-major -> source-major again
            y = all_to_all(y[back], group, in_splits, out_splits, self.hand_over)
        else:
            y = self.experts(sent, counts.tolist())
        per_slot = y.new_zeros(t * k, y.size(-1)).index_copy(0, slots, y)
        return per_slot.view(t, k, -1)

    def _allgather(self, tokens, experts, keep) -> torch.Tensor:
        """Every EP rank's tokens here; this rank's experts' outputs reduce-scattered back."""
        t, k = experts.shape
        group, local = self.state.ep_group, self.experts.local
        everyone = gather_from_expert_region(tokens, group)  # (EP T, h)
        ids = all_gather_rows(torch.where(keep, experts, -1), group).reshape(-1)  # (EP T k)
        first = self.state.ep_rank * local
        mine = torch.nonzero((ids >= first) & (ids < first + local)).squeeze(1)
        order = torch.argsort(ids[mine], stable=True)
        slots, ids = mine[order], ids[mine][order] - first
        counts = torch.bincount(ids, minlength=local).tolist()
        y = self.experts(everyone[slots // k], counts)
        per_slot = y.new_zeros(everyone.size(0) * k, y.size(-1)).index_copy(0, slots, y)
        return reduce_scatter_to_expert_region(per_slot.view(-1, k, y.size(-1)), group)


def _gather_routing(x, probs, experts, keep, group):
    """Sequence parallelism at ETP > 1: this rank's (b, s/p, .) tokens and routing -> the TP
    group's (b, s, .), in sequence order. Every TP rank then computes the same outputs, so the
    gradients of x and of the probabilities come back as this rank's slice (not a sum)."""
    b, k = x.size(0), experts.size(1)
    x = gather_from_sequence_parallel_region(x, group, grad_is_partial=False)
    probs = gather_from_sequence_parallel_region(probs.view(b, -1, k), group, False)
    chosen = all_gather_sequence(torch.where(keep, experts, -1).view(b, -1, k), group)
    chosen = chosen.reshape(-1, k)
    return x, probs.reshape(-1, k), chosen.clamp(min=0), chosen >= 0


def _source_major_to_expert_major(received: torch.Tensor) -> torch.Tensor:
    """received (EP, L) counts of rows ordered (source rank, expert) -> the row order that
    sorts them by (expert, source rank)."""
    flat = received.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where block (j, l) starts
    blocks = starts.view(received.shape).t().reshape(-1)  # (l, j) order
    sizes = received.t().reshape(-1)
    within = torch.arange(int(sizes.sum()), device=received.device)
    block_start = torch.cumsum(sizes, 0) - sizes
    which = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes)
    return blocks[which] + within - block_start[which]


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]


def set_moe_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the aux and z losses get in backward: what the trainer multiplies the LM
    loss by (1 / micro batches, times the fp16 loss scale, times CP: the gradients of the CP
    ranks' loss shares are averaged over DP x CP like the LM loss's)."""
    for _, layer in moe_layers(model):
        layer.loss_grad_scale = float(scale)


def moe_step_stats(model: nn.Module, state, cfg: ModelConfig, updated=True) -> dict:
    """The MoE statistics of the step just run, the same on every rank ({} without MoE): the
    load-balancing and z losses (each summed over the MoE layers, per micro batch) and the
    mean over layers of max / mean tokens per expert. One all-reduce over all ranks (also those
    whose pipeline stage has no MoE layer); resets. With --moe-router-enable-expert-bias the
    same tokens per expert then move the expert biases (`update_expert_bias`; not where the
    optimizer skipped the step: `updated`, a bool or a device flag).

    A layer's numbers are counted once per replica: on TP rank 0, or, with sequence
    parallelism, on every TP rank, and on every CP rank (each routed its own tokens; their loss
    shares add up); the micro batches once, on TP and CP rank 0."""
    if not cfg.moe:
        return {}
    rows = cfg.num_layers + (cfg.mtp_num_layers or 0)  # the MTP depths' layers follow
    table = torch.zeros(rows, 3 + cfg.num_experts)  # [aux, z, micro batches, load]
    split = state.sequence_parallel
    for name, layer in moe_layers(model):
        values = layer.stats.values
        layer.stats.reset()
        if values is None or not (split or state.tp_rank == 0):
            continue
        values = values.detach().to("cpu", torch.float32)
        if state.tp_rank != 0 or state.cp_rank != 0:
            values[2] = 0  # one micro-batch count per replica
        table[_layer_number(name, cfg.num_layers)] += values
    device = next(model.parameters()).device
    table = table.to(device)
    if state.world_size > 1:  # every rank of the job
        dist.all_reduce(table)
    if cfg.moe_router_enable_expert_bias:
        update_expert_bias(model, table[:, 3:], cfg.moe_router_bias_update_rate, updated)
    used = table[:, 2] > 0
    table = table[used]
    per_micro = table[:, :2] / table[:, 2:3]  # (layers, [aux, z])
    load = table[:, 3:]
    balance = (load.max(1).values / load.mean(1).clamp(min=1e-9)).mean()
    return {
        "load balancing loss": per_micro[:, 0].sum(),
        "z loss": per_micro[:, 1].sum(),
        "expert load max/mean": balance,
    }


def _layer_number(name: str, num_layers: int) -> int:
    """The global layer index in a module name (`...layers.<i>.mlp`, at any PP layout); the
    multi-token prediction depth k's layer (`mtp.layers.<k>.transformer_layer.mlp`): L + k."""
    number = int(name.split("layers.")[1].split(".")[0])
    return num_layers + number if "mtp.layers." in name else number


@torch.no_grad()
def update_expert_bias(model: nn.Module, load: torch.Tensor, rate: float, updated=True) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3; Megatron-core's get_updated_expert_bias):
    b_e += rate x sign(mean_e' load_e' - load_e), load (layers, E) the tokens each expert got
    over the whole global batch (every micro batch, every DP x CP (x EP) rank, already
    all-reduced), so every rank moves its copy alike. Not on a skipped step (`updated` False,
    or a device flag that is 0: no host read)."""
    if updated is False:
        return
    for name, layer in moe_layers(model):
        bias = layer.router.expert_bias
        if bias is None:
            continue
        row = _layer_number(name, layer.cfg.num_layers)
        counts = load[row].to(bias.device, torch.float32)  # exact integers
        step = torch.sign(counts.sum() - counts.numel() * counts) * rate  # sign(mean - load)
        if isinstance(updated, torch.Tensor):
            step = step * updated.to(bias.device, torch.float32)
        bias.add_(step)
