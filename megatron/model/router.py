"""The MoE router: fp32 logits x W_r^T (T, E), the top-k choice of experts and its weights,
capacity, and the load-balancing and z losses (megatron.model.moe builds it into MoELayer).

Scores as Megatron-core's topk_routing_with_score_function:
  softmax   p = softmax(top-k logits) (Mixtral), or with --moe-router-pre-softmax the top k of
            softmax(logits) as they are (Qwen2-MoE)
  sigmoid   s = sigmoid(logits); experts = top-k(s + b), p = s_chosen / sum s_chosen (k > 1)
            (DeepSeek-V3), b the expert bias (--moe-router-enable-expert-bias): it moves the
            choice, never the weights, and moves after each step (megatron.model.moe
            `update_expert_bias`), not through the optimizer
  then p x --moe-router-topk-scaling-factor; with --moe-router-group-topk the top k are taken
  from the best groups only (`select_topk`).

Load balancing (switch transformer): aux = coeff E / (k T^2) sum_e count_e sum_t p_te over the
micro batch's T tokens (seq_aux_loss: per sequence, averaged), z = coeff mean_t lse(logits_t)^2;
its scores are softmax(logits), or sigmoid(logits) normalized over E, and its counts those of
the plain top k of them (without bias or group limit, as Megatron-core counts). With context
parallelism (and sequence parallelism) each rank holds pieces of the sequences: the counts are
summed over those ranks (`state.sequence_group`) and each rank adds its tokens' share, so the
shares add up to the unsplit losses.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext


def route(logits: torch.Tensor, m: ModelConfig, expert_bias: torch.Tensor | None = None):
    """fp32 logits (T, E) -> (probs (T, k), experts (T, k), scores (T, E) for the aux loss), as
    Megatron-core's topk_routing_with_score_function.

    softmax: the top k logits, then a softmax over them (Mixtral), or with pre-softmax the
    top k of the softmax over all E as they are (Qwen2-MoE). sigmoid (DeepSeek-V3): the top k
    of sigmoid(logits) + expert_bias (the bias moves the choice only), their unbiased scores
    divided by their sum when k > 1. Then x --moe-router-topk-scaling-factor. With
    --moe-router-group-topk the choice is group-limited (`select_topk`)."""
    k = m.moe_router_topk
    if m.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        biased = scores if expert_bias is None else scores + expert_bias.float()
        experts = select_topk(biased, m)[1]
        probs = scores.gather(1, experts)
        if k > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    else:
        aux_scores = torch.softmax(logits, dim=-1)
        if m.moe_router_pre_softmax:  # softmax over all E, then the top k as they are
            probs, experts = select_topk(aux_scores, m)
        else:  # the top k logits, then a softmax over them
            top, experts = select_topk(logits, m)
            probs = torch.softmax(top, dim=-1)
    if m.moe_router_topk_scaling_factor:
        probs = probs * m.moe_router_topk_scaling_factor
    return probs, experts, aux_scores


def select_topk(scores: torch.Tensor, m: ModelConfig):
    """(values, indices) (T, k) of the top k of scores (T, E). Group-limited routing
    (--moe-router-num-groups G, --moe-router-group-topk g): the E experts in G consecutive
    groups, each scored by the sum of its top k / g scores (DeepSeek-V3's top 2 at k 8, g 4);
    a token takes its k from its top g groups only (Megatron-core's group_limited_topk)."""
    k, g = m.moe_router_topk, m.moe_router_group_topk
    if not g:
        return scores.topk(k, dim=-1)
    t, e = scores.shape
    groups = m.moe_router_num_groups
    per_group = scores.view(t, groups, e // groups)  # (T, G, E / G)
    group_scores = per_group.topk(k // g, dim=-1).values.sum(-1)  # (T, G)
    chosen = group_scores.topk(g, dim=-1, sorted=False).indices  # (T, g)
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    allowed = allowed.unsqueeze(-1).expand_as(per_group).reshape(t, e)  # (T, E)
    return scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)


def capacity_keep(probs, experts, num_experts: int, factor: float, policy: str) -> torch.Tensor:
    """(T, k) booleans: the assignments an expert keeps with capacity ceil(T k / E x factor):
    its highest-probability ones (probs) or its first tokens (position)."""
    t, k = experts.shape
    capacity = math.ceil(t * k / num_experts * factor)
    routed = torch.zeros(t, num_experts, dtype=torch.bool, device=experts.device)
    routed.scatter_(1, experts, True)
    if capacity >= t:
        return torch.ones_like(experts, dtype=torch.bool)
    if policy == "probs":
        rank_by = torch.zeros(t, num_experts, device=probs.device).scatter(1, experts, probs)
    else:  # earlier tokens first
        position = torch.arange(t, 0, -1, device=experts.device, dtype=torch.float32)
        rank_by = position.unsqueeze(1).expand(t, num_experts)
    rank_by = rank_by.masked_fill(~routed, -1.0)
    kept = rank_by.topk(capacity, dim=0).indices  # (capacity, E)
    keep = torch.zeros_like(routed).scatter_(0, kept, True) & routed
    return keep.gather(1, experts)


class Router(nn.Module):
    """x (T, h) -> (probs (T, k), experts (T, k), kept (T, k), aux loss, z loss, tokens per
    expert (E,)): the top-k routing of T tokens, dropped assignments' probabilities zeroed.

    --moe-router-enable-expert-bias: `expert_bias` (E,), an fp32 buffer (kept fp32 when the
    model is cast, as Megatron-core does), saved with the weights, the same on every rank; it
    moves only the choice of experts and is updated after each optimizer step from the global
    batch's tokens per expert (`update_expert_bias`), never by the optimizer."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.cfg, self.state = cfg, ctx.state
        shape = (cfg.num_experts, cfg.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape, device=ctx.device, dtype=ctx.dtype))
        bias = None
        if cfg.moe_router_enable_expert_bias:
            bias = torch.zeros(cfg.num_experts, device=ctx.device, dtype=torch.float32)
        self.register_buffer("expert_bias", bias)  # None: not in the state dict

    def _apply(self, fn, recurse=True):
        """model.half() / .to(bf16) cast the weight, never the fp32 expert bias (it moves)."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(self.expert_bias.device, torch.float32)
        return self

    def forward(self, x: torch.Tensor, batch: int):
        m = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # (T, E) in fp32
        probs, experts, scores = route(logits, m, self.expert_bias)
        if m.moe_expert_capacity_factor is not None:
            keep = capacity_keep(
                probs, experts, m.num_experts, m.moe_expert_capacity_factor, m.moe_token_drop_policy
            )
            probs = probs * keep
        else:
            keep = torch.ones_like(experts, dtype=torch.bool)
        counts = torch.bincount(experts[keep], minlength=m.num_experts)
        unbiased = experts  # the aux loss counts the plain top k of its scores (Megatron-core)
        if m.moe_router_enable_expert_bias or m.moe_router_group_topk:
            unbiased = scores.topk(m.moe_router_topk, dim=-1).indices
        aux, z = self._balance_loss(scores, unbiased, batch), self._z_loss(logits)
        return probs, experts, keep, aux, z, counts

    def _over_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """A statistic summed over the ranks holding other tokens of the same sequences
        (`state.sequence_group`: CP ranks, times TP ranks under sequence parallelism)."""
        if self.state.sequence_shards > 1:
            t = t.clone()
            dist.all_reduce(t, group=self.state.sequence_group)
        return t

    def _balance_loss(self, scores: torch.Tensor, experts: torch.Tensor, batch: int):
        """This rank's share of coeff E / (k T^2) sum_e count_e sum_t p_te: the counts are the
        whole micro batch's (summed over the CP and, under sequence parallelism, TP ranks that
        hold pieces of its sequences), the probabilities this rank's, so the shares add up to
        the loss and its gradient. seq_aux_loss: the same per whole sequence, averaged."""
        m, e, k = self.cfg, self.cfg.num_experts, self.cfg.moe_router_topk
        kind = m.moe_router_load_balancing_type
        if kind == "none" or m.moe_aux_loss_coeff == 0:
            return scores.new_zeros(())
        groups = batch if kind == "seq_aux_loss" else 1  # per sequence, or the whole micro batch
        chosen = torch.zeros_like(scores).scatter_(1, experts, 1.0)  # (T, E) routing map
        counts = self._over_tokens(chosen.view(groups, -1, e).sum(1).detach())  # (groups, E)
        tokens = scores.size(0) // groups * self.state.sequence_shards  # per group, all ranks
        prob_sums = scores.view(groups, -1, e).sum(1)  # (groups, E), this rank's tokens
        per_group = (counts * prob_sums).sum(-1) * (e / (k * tokens * tokens))
        return m.moe_aux_loss_coeff * per_group.mean()

    def _z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of coeff mean_t lse_t^2 over the micro batch's tokens."""
        coeff = self.cfg.moe_z_loss_coeff
        if not coeff:
            return logits.new_zeros(())
        total = logits.size(0) * self.state.sequence_shards
        return coeff * torch.logsumexp(logits, dim=-1).square().sum() / total
