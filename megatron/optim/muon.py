"""--optimizer muon: the transformer layers' matrices take Muon, every other parameter AdamW.

Muon (Keller Jordan 2024; Moonlight, "Muon is Scalable for LLM Training", 2025) is momentum SGD
whose update is replaced by the nearest semi-orthogonal matrix, computed by Newton-Schulz:

    B_t = mu B_{t-1} + (1 - mu) g_t             momentum (torch.optim.Muon's, Megatron-core's)
    U_t = (1 - mu) g_t + mu B_t                 Nesterov (--no-muon-nesterov: U_t = B_t)
    O_t = NS_k(U_t)                             k quintic steps (3.4445, -4.775, 2.0315)
    W_t = W_{t-1} (1 - lr wd) - lr s(A, B) O_t  decoupled weight decay

`s(A, B)` for an A x B matrix is --muon-scale-mode times --muon-extra-scale-factor, as
Megatron-core names them: spectral sqrt(max(A, B)), unit_rms_norm sqrt(A / B), shape_scaling
sqrt(max(1, A / B)). The default, spectral x 0.2, is Moonlight's rule: O_t has RMS about
1 / sqrt(max(A, B)), so 0.2 sqrt(max(A, B)) O_t has AdamW's typical update RMS (0.2) and the
same --lr serves both halves of the optimizer.

What takes Muon: the 2-D weights inside the transformer layers. Embeddings, the output head and
every 1-D parameter (norms, biases) take AdamW with --lr / --adam-beta1/2 / --adam-eps.

Orthogonalised per logical matrix: the fused query_key_value weight (rows per query group
[q_1..q_{n/g}, k, v], megatron.model.transformer) is taken apart into Q (n d x h), K and V
(g d x h), and SwiGLU's [gate; up] into gate and up, each orthogonalised and scaled by its own
shape (Megatron-core's --muon-split-qkv): they are different linear maps, and NS of the stack
would couple their singular values and scale them by the stack's shape.

A TP-split matrix is orthogonalised whole: each part's TP shards are all-gathered along the
partition dim, NS runs on the whole matrix on every TP rank, and each rank keeps its slice
(Megatron-core's --muon-tp-mode duplicated), so the update equals the single-process one.
Newton-Schulz runs in fp32: torch.optim.Muon runs it in bf16, which on the CPU measured no
faster, and fp32 keeps the parallel layouts equal to one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adam import adam as adam_functional

from megatron.model.attention.standard import ParallelAttention
from megatron.model.transformer import TransformerLayer
from megatron.mpu.utils import group_rank, group_size
from megatron.optim.elementwise import set_weight_decay

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


def newton_schulz(x: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards U V^T (x = U S V^T), in fp32. The wide
    orientation keeps the Gram matrix (rows x rows) the small one."""
    a, b, c = NS_COEFFICIENTS
    tall = x.size(0) > x.size(1)
    y = x.float().mT if tall else x.float()  # (small, large)
    y = y / y.norm().clamp(min=eps)  # Frobenius >= spectral norm: singular values in [0, 1]
    for _ in range(steps):
        gram = y @ y.mT  # (small, small)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        y = torch.addmm(y, poly, y, beta=a)  # a Y + (b G + c G^2) Y
    return y.mT if tall else y


def scale_factor(rows: int, cols: int, mode: str, extra: float) -> float:
    """s(A, B) of the module doc, for a rows x cols (out x in) logical matrix."""
    if mode == "spectral":
        base = max(rows, cols) ** 0.5
    elif mode == "unit_rms_norm":
        base = (rows / cols) ** 0.5
    elif mode == "shape_scaling":
        base = max(1.0, rows / cols) ** 0.5
    else:
        raise ValueError(f"--muon-scale-mode {mode!r}: choose one of {', '.join(SCALE_MODES)}")
    return extra * base


@dataclass(frozen=True)
class MuonSettings:
    ns_steps: int = 5
    scale_mode: str = "spectral"
    extra_scale: float = 0.2
    split_qkv: bool = True


@dataclass(frozen=True)
class MatrixLayout:
    """How one TP-local weight of `shape` is made of logical matrices.

    `partition_dim`: the dim its TP shards split (None: every TP rank holds it whole).
    `qkv`: (local query groups, queries per group, head dim) of a fused query_key_value weight.
    `stacked`: matrices stacked along dim 0, each TP-split on its own (SwiGLU's [gate; up]: 2).
    `experts`: an MoE expert weight (local experts, in, out) of this rank's whole experts (not
    split over ETP); each expert's (out x in) matrix, [gate; up] taken apart, is one matrix.
    """

    name: str
    shape: tuple[int, ...]
    partition_dim: int | None = None
    qkv: tuple[int, int, int] | None = None
    stacked: int = 1
    experts: bool = False

    def parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """This rank's slice of each logical matrix (each a slice along partition_dim)."""
        t = t.view(self.shape)
        if self.experts:  # (E, in, out) -> per expert (out, in), split in `stacked`
            return [m for w in t.unbind(0) for m in w.mT.chunk(self.stacked, dim=0)]
        if self.qkv is not None:
            g, per, d = self.qkv
            t4 = t.view(g, per + 2, d, self.shape[1])  # (groups, [q_1..q_per, k, v], d, h)
            return [t4[:, :per].reshape(-1, self.shape[1])] + [
                t4[:, i].reshape(-1, self.shape[1]) for i in (per, per + 1)
            ]
        return list(t.chunk(self.stacked, dim=0))

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of `parts`: the TP-local weight's layout again."""
        if self.experts:
            k = self.stacked
            per = [torch.cat(parts[i : i + k], dim=0).mT for i in range(0, len(parts), k)]
            return torch.stack(per).reshape(self.shape)
        if self.qkv is not None:
            g, per, d = self.qkv
            q, k, v = (p.reshape(g, -1, d, self.shape[1]) for p in parts)  # (g, n, d, h)
            return torch.cat([q, k, v], dim=1).reshape(self.shape)
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def orthogonalize(
    update: torch.Tensor, layout: MatrixLayout, settings: MuonSettings, tp_group=None
) -> torch.Tensor:
    """s(A, B) NS(U) of each logical matrix of the TP-local `update`, in the TP-local layout.
    A TP-split matrix: all-gather along its partition dim (collective over `tp_group`), NS of
    the whole, this rank's slice kept."""
    split = layout.partition_dim is not None and group_size(tp_group) > 1
    size, rank = group_size(tp_group), group_rank(tp_group)
    out = []
    for part in layout.parts(update):
        whole = part
        if split:
            shards = [torch.empty_like(part) for _ in range(size)]
            dist.all_gather(shards, part.contiguous(), group=tp_group)
            whole = torch.cat(shards, dim=layout.partition_dim)  # the unsplit matrix
        o = newton_schulz(whole, settings.ns_steps)
        o = o * scale_factor(*whole.shape, settings.scale_mode, settings.extra_scale)
        out.append(o.chunk(size, dim=layout.partition_dim)[rank] if split else o)
    return layout.join(out).to(update.dtype)


def matrix_layouts(model: nn.Module, settings: MuonSettings) -> dict[int, MatrixLayout]:
    """id(param) -> layout of every parameter Muon takes: the 2-D weights of the transformer
    layers (embeddings, the output head, norms and biases are left to AdamW)."""
    qkv = {}
    for module in model.modules():
        if isinstance(module, ParallelAttention) and settings.split_qkv:
            qkv[id(module.query_key_value.weight)] = (
                module.groups,
                module.q_per_group,
                module.head_dim,
            )
    layouts: dict[int, MatrixLayout] = {}
    for module in model.modules():
        if not isinstance(module, TransformerLayer):
            continue
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in layouts:
                continue
            if getattr(p, "expert_parallel", False):  # weights (E, in, out); biases (E, out)
                if p.ndim == 3:  # are AdamW's, as every bias
                    layouts[id(p)] = _expert_layout(name, p, settings)
                continue
            if p.ndim != 2:
                continue
            split = bool(getattr(p, "tensor_model_parallel", False))
            layouts[id(p)] = MatrixLayout(
                name,
                tuple(p.shape),
                int(p.partition_dim) if split else None,
                qkv.get(id(p)),
                # a stride-s weight stacks s matrices (SwiGLU's [gate; up]); unsplit, NS of the
                # TP-gathered rows [g_0; u_0; g_1; u_1] is NS of [gate; up] with its rows moved
                int(getattr(p, "partition_stride", 1)) if split and settings.split_qkv else 1,
            )
    return layouts


def _expert_layout(name: str, p: torch.Tensor, settings: MuonSettings) -> MatrixLayout:
    """An MoE expert weight, (local experts, in, out); weight1 under SwiGLU stacks [gate; up]
    along its out dim (partition stride 2)."""
    if getattr(p, "expert_tensor_parallel", False):  # rules_training refuses it before
        raise ValueError(f"Muon: {name} is split over --expert-tensor-parallel-size")
    part = getattr(p, "expert_partition", None)
    stacked = part[1] if part is not None and settings.split_qkv else 1
    return MatrixLayout(name, tuple(p.shape), None, None, stacked, experts=True)


Orthogonalizer = Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]


class MuonAdamW(torch.optim.Optimizer):
    """One torch optimizer for both halves, so checkpoints, the LR schedule and the resharding
    code see one state keyed by position: parameters in `muon_params` keep Muon's
    `momentum_buffer`, the others AdamW's `exp_avg`, `exp_avg_sq` and `step` (torch's names;
    megatron.config.optimizers' entry says so for the resume check, which reads `matrix_ids`).

    `orthogonalize(mains, updates)`: s NS(U) of every Muon parameter with a gradient, in one
    call per step on every rank (it may run collectives)."""

    def __init__(self, groups, *, muon_params, orthogonalize: Orthogonalizer, **defaults):
        super().__init__(groups, {"weight_decay": 0.0, **defaults})
        self.matrix_ids = {id(p) for p in muon_params}
        self.orthogonalize = orthogonalize

    def __setstate__(self, state: dict) -> None:
        """After load_state_dict: groups saved by another optimizer get this one's defaults."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        muon = []  # (group, main, U_t)
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            self._adamw(group, [p for p in with_grad if id(p) not in self.matrix_ids])
            muon += [
                (group, p, self._momentum(group, p)) for p in with_grad if id(p) in self.matrix_ids
            ]
        updates = self.orthogonalize([p for _, p, _ in muon], [u for *_, u in muon])
        for (group, p, _), o in zip(muon, updates, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(o.to(p.device), alpha=-group["lr"])

    def _momentum(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """B_t and the update U_t that NS takes (module doc)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf, mu = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - mu)
        return p.grad.lerp(buf, mu) if group["nesterov"] else buf.clone()

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's AdamW (its functional form, decoupled weight decay) on `params`."""
        if not params:
            return
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam_functional(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=len({p.device for p in params}) == 1,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def muon_settings(cfg) -> MuonSettings:
    """The Muon flags of an OptimizerConfig."""
    return MuonSettings(
        cfg.muon_num_ns_steps, cfg.muon_scale_mode, cfg.muon_extra_scale_factor, cfg.muon_split_qkv
    )


def build(groups: list[dict], cfg, feed) -> MuonAdamW:
    """The table's builder: MuonAdamW over the param groups (their weight_decay set from
    wd_mult); the backend's `feed` (megatron.optim.matrices.Feed) finds the mains of the matrices
    and runs s NS(U) on each whole."""
    settings = muon_settings(cfg)
    layouts = matrix_layouts(feed.module, settings)

    def whole(p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        return orthogonalize(update, layouts[id(p)], settings, feed.tp_group)

    return build_muon(groups, cfg, feed.mains_of(layouts), feed.whole(layouts, whole))


def build_muon(groups: list[dict], cfg, muon_params, orthogonalizer: Orthogonalizer) -> MuonAdamW:
    """MuonAdamW over the param groups (their weight_decay set from wd_mult)."""
    return MuonAdamW(
        set_weight_decay(groups, cfg),
        muon_params=muon_params,
        orthogonalize=orthogonalizer,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
    )
