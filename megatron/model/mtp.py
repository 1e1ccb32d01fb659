"""Multi-token prediction (DeepSeek-V3 report, section 2.2; Megatron-core's --mtp-num-layers).

D sequential modules on the last pipeline stage. Module k (1..D) sees, at position i, the
previous depth's hidden state h_i^{k-1} (h^0: the main model's output after its final norm) and
the embedding of token t_{i+k}:

    h'_i^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])        (2h -> h)
    h_i^k  = final_norm_k(TransformerLayer_k(h'^k))_i

and predicts t_{i+k+1} through the shared output head (the word embedding when tied, else the
output layer, as Megatron-core does). The tokens, labels and loss mask are rolled left k places,
the last k positions masked. L_k is the masked mean cross entropy of depth k; training minimises
L_main + factor / D x sum_k L_k. The L_k join backward through an identity on the main per-token
loss (`_AttachLoss`), so the schedules, the loss function and "lm loss" stay the main model's;
each L_k is logged apart ("mtp_k loss", `mtp_step_stats`). Evaluation and generation skip them.

Tensor parallelism: eh_proj is column-parallel, its output gathered over TP (with sequence
parallelism, scattered again to this rank's s / p positions); the layer is the model's own.
Context parallelism: the tokens, labels and loss mask of the whole sequences are all-gathered
over CP once (b x s integers), rolled whole and cut into this rank's chunks again; each CP rank
adds its share of L_k (its masked sum over the whole count), as the main loss does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.config.layer_pattern import layer_kinds
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.layer_kinds import build_layer
from megatron.model.norms import build_norm
from megatron.model.recompute import run_layers
from megatron.mpu.context_parallel import context_parallel_slice, context_parallel_unslice
from megatron.mpu.layers import ColumnParallelLinear
from megatron.mpu.mappings import scatter_to_sequence_parallel_region


class _AttachLoss(torch.autograd.Function):
    """Forward: y = x. Backward: x gets y's gradient and `loss` gets `scale`, the gradient the
    trainer gives the main loss (1 / micro batches x the fp16 loss scale)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        loss_grad = torch.full((), ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, loss_grad, None


def roll_left(x: torch.Tensor) -> torch.Tensor:
    """(b, s) -> x shifted one place to the left along s, the freed last place zero."""
    rolled = torch.roll(x, -1, dims=-1)
    rolled[..., -1] = 0
    return rolled


class MultiTokenPredictionLayer(nn.Module):
    """One depth: (h^{k-1}, Emb(t_{i+k})) -> h^k, both (b, s, h) or (b, s/p, h) under SP.

    The transformer layer is built as the main model's last layer (an MoE layer where that one
    is, as Megatron-core builds it from the last layer's spec)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        state, kw = ctx.state, {"device": ctx.device, "dtype": ctx.dtype}
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.enorm = build_norm(cfg, **kw)
        self.hnorm = build_norm(cfg, **kw)
        self.eh_proj = ColumnParallelLinear(
            2 * cfg.hidden_size,
            cfg.hidden_size,
            group=state.tp_group,
            bias=False,
            gather_output=True,
            init_method=None,  # drawn by megatron.model.weights
            sequence_parallel=state.sequence_parallel,
            **kw,
        )
        # the main model's last layer's kind
        self.transformer_layer = build_layer(layer_kinds(cfg), cfg, ctx, cfg.num_layers - 1)
        self.final_layernorm = build_norm(cfg, **kw)

    def forward(self, hidden, embedded, position_ids, mask, recompute, tracker):
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # (b, s[/p], 2h)
        x = self.eh_proj(x)  # (b, s, h): gathered over TP
        if self.sequence_parallel:  # back to this rank's (b, s/p, h)
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        x = run_layers(
            [self.transformer_layer], x, position_ids, mask, recompute, tracker, self.training
        )
        return self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """The D depths, their losses attached to the main loss, and their sums for the log."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext):
        super().__init__()
        depth, self.state = cfg.mtp_num_layers, ctx.state
        self.layers = nn.ModuleList(MultiTokenPredictionLayer(cfg, ctx) for _ in range(depth))
        self.weight = cfg.mtp_loss_scaling_factor / depth
        self.loss_grad_scale = 1.0  # set_mtp_loss_scale
        self.sums: torch.Tensor | None = None  # [L_1 .. L_D, micro batches] since the last read

    def forward(self, main_loss, hidden, tokens, labels, loss_mask, embed, token_loss, **layer):
        """main_loss (b, s): the main model's per-token loss, returned with the D losses
        attached. hidden: h^0; embed(tokens) -> (b, s[/p], h); token_loss(h^k, labels) -> (b, s)
        fp32; `layer`: position_ids, mask, recompute, tracker for the transformer layers."""
        mask = torch.ones_like(main_loss) if loss_mask is None else loss_mask.to(main_loss.dtype)
        tokens, labels, mask = (self._whole(x) for x in (tokens, labels, mask))
        losses = []
        for module in self.layers:  # depth k: inputs t_{i+k}, targets t_{i+k+1}
            tokens, labels, mask = roll_left(tokens), roll_left(labels), roll_left(mask)
            hidden = module(hidden, embed(self._mine(tokens)), **layer)
            per_token = token_loss(hidden, self._mine(labels))  # this CP rank's tokens
            losses.append((per_token * self._mine(mask)).sum() / mask.sum().clamp(min=1))
        losses = torch.stack(losses)  # under CP: this rank's shares of L_1 .. L_D
        counted = float(self.state.cp_rank == 0)  # one micro batch per CP group
        row = torch.cat([losses.detach().float(), losses.new_full((1,), counted).float()])
        self.sums = row if self.sums is None else self.sums + row
        return _AttachLoss.apply(main_loss, self.weight * losses.sum(), self.loss_grad_scale)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """Context parallelism: this rank's chunks (b, 2c) -> the whole sequences (b, s)."""
        if self.state.cp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.state.cp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.state.cp_group)
        return context_parallel_unslice(parts)

    def _mine(self, x: torch.Tensor) -> torch.Tensor:
        return context_parallel_slice(x, self.state.cp_rank, self.state.cp_size)


def mtp_modules(model: nn.Module) -> list[MultiTokenPrediction]:
    return [m for m in model.modules() if isinstance(m, MultiTokenPrediction)]


def set_mtp_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the MTP losses get in backward: what the trainer multiplies the main loss
    by (1 / micro batches, times the fp16 loss scale)."""
    for module in mtp_modules(model):
        module.loss_grad_scale = float(scale)


def mtp_step_stats(model: nn.Module, state, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """{"mtp_k loss": L_k} of the step just run, averaged over its micro batches and the DP
    ranks, the same on every rank ({} without MTP). One all-reduce over all ranks (those
    without the last stage add zeros; TP ranks hold the same losses: TP rank 0 counts; CP
    ranks add their shares); resets."""
    if not cfg.mtp_num_layers:
        return {}
    device = next(model.parameters()).device
    table = torch.zeros(cfg.mtp_num_layers + 1, device=device)
    for module in mtp_modules(model):
        if module.sums is not None and state.tp_rank == 0:
            table += module.sums.to(device)
        module.sums = None
    if state.world_size > 1:
        dist.all_reduce(table)
    per_depth = table[:-1] / table[-1].clamp(min=1)
    return {f"mtp_{k + 1} loss": per_depth[k] for k in range(cfg.mtp_num_layers)}
