"""Every layout the configuration rules accept for a world size, with its predicted memory and
step time; the ranked list and the --auto-parallel choice.

A candidate is the user's config with TP, CP, PP, virtual stages, sequence parallelism, micro
batch and recompute replaced; it is kept only if megatron.config.rules.validate(cfg, "train-gpt")
accepts it, so the planner never proposes a layout that training would refuse. The global batch
is the user's: it fixes M = batch / (micro batch x DP).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass

from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.config.schema import MegatronConfig
from megatron.planning.memory import (
    Device,
    GiB,
    Layout,
    MemoryEstimate,
    Training,
    gib_above,
)
from megatron.planning.pipeline_memory import estimate_memory
from megatron.planning.timing import Hardware, limiting_term, mfu, step_time
from megatron.schedules.registry import get_schedule


@dataclass(frozen=True)
class Search:
    """What to search over, on what machine."""

    world_size: int
    gpu_memory_gb: float
    hardware: Hardware = Hardware()
    device: Device = Device()
    micro_batches: tuple[int, ...] | None = None  # default: every divisor of batch / DP up to 16
    recompute: tuple[str | None, ...] = (None, "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    interleave: bool = True
    tensor_parallel: tuple[int, ...] | None = None  # default: every divisor of the world size
    pipeline_parallel: tuple[int, ...] | None = None
    context_parallel: tuple[int, ...] | None = None  # default: every divisor of world / (TP PP)
    expert_parallel: tuple[int, ...] | None = None  # MoE; default: divisors of DP x CP and E
    expert_tensor_parallel: int | None = None  # MoE: 1 (experts whole over TP) or None (= TP)
    memory_flag: str = "--gpu-memory"  # the flag that gave gpu_memory_gb, named in the fix
    # --pipeline-schedule values tried at PP > 1 besides the defaults (1F1B, interleaved), or with
    # `only_schedules` (a --pipeline-schedule given) instead of them
    schedules: tuple[str, ...] = ()
    only_schedules: bool = False


@dataclass(frozen=True)
class Plan:
    layout: Layout
    cfg: MegatronConfig
    memory: MemoryEstimate
    time: dict[str, float]
    fits: bool
    mfu: float

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    @property
    def limit(self) -> str:
        return limiting_term(self.time)


class PlanError(ValueError):
    """No layout is valid, or none fits; the message names the smallest fix."""


def training_of(cfg: MegatronConfig) -> Training:
    """The memory model's view of the run settings."""
    o, ds = cfg.optimizer, cfg.deepspeed
    sharding = "distributed" if o.use_distributed_optimizer else "none"
    if ds.enabled and ds.zero_stage:
        sharding = {1: "distributed", 2: "zero2", 3: "zero3"}[ds.zero_stage]
    if cfg.distributed.use_torch_fsdp2:  # MoE is refused with it
        sharding = "fsdp2"
    return Training(
        dtype_bytes=2 if (cfg.precision.fp16 or cfg.precision.bf16) else 4,
        optimizer=o.optimizer,
        sgd_momentum=o.sgd_momentum,
        sharding=sharding,
        recompute_method=cfg.recompute.method,
        recompute_num_layers=cfg.recompute.num_layers,
        attention_backend=cfg.kernels.attention_backend,
        cross_entropy_fusion_impl=cfg.kernels.cross_entropy_fusion_impl,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate(cfg: MegatronConfig, world: int, lay: Layout) -> MegatronConfig:
    """`cfg` with the layout's settings (the config that training would run)."""
    vlayers = None if lay.vp is None or lay.v_shape else cfg.model.num_layers // (lay.pp * lay.vp)
    par = dataclasses.replace(
        cfg.parallel,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        num_layers_per_virtual_pipeline_stage=vlayers,
        pipeline_schedule=lay.schedule or cfg.parallel.pipeline_schedule,
        sequence_parallel=lay.sequence_parallel,
        context_parallel_size=lay.cp,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp,
        world_size=world,
    )
    return cfg.replace(
        parallel=par,
        training=dataclasses.replace(cfg.training, micro_batch_size=lay.micro_batch),
        recompute=dataclasses.replace(cfg.recompute, granularity=lay.recompute),
    )


def _check(cfg: MegatronConfig) -> None:
    """The training rules, with placeholders for the settings a plan does not need (length
    of the run, learning rate) so only layout problems can fail."""
    t, o = cfg.training, cfg.optimizer
    if t.train_iters is None and t.train_samples is None:
        t = dataclasses.replace(t, train_iters=1)
    if o.lr is None:
        o = dataclasses.replace(o, lr=1.0)
    validate(cfg.replace(training=t, optimizer=o), "train-gpt")


def _candidates(cfg: MegatronConfig, s: Search):
    """Every combination of the searched settings (not yet checked by the rules)."""
    m, gbs = cfg.model, cfg.training.global_batch_size
    for tp in _divisors(s.world_size):
        for pp in _divisors(s.world_size // tp):
            if (s.tensor_parallel and tp not in s.tensor_parallel) or (
                s.pipeline_parallel and pp not in s.pipeline_parallel
            ):
                continue
            for cp in _divisors(s.world_size // (tp * pp)):
                if not s.context_parallel or cp in s.context_parallel:
                    yield from _layouts_of(m, s, gbs, tp, pp, cp)


def _layouts_of(m, s: Search, gbs: int, tp: int, pp: int, cp: int):
    """The candidates of one TP x PP x CP split: virtual stages, micro batch, recompute, SP."""
    dp = s.world_size // (tp * pp * cp)
    vps = [None]
    if s.interleave and pp > 1 and m.num_layers % pp == 0:
        vps += [v for v in _divisors(m.num_layers // pp) if v > 1]
    per_rank = gbs // dp if gbs % dp == 0 else 0
    mbs = s.micro_batches or [b for b in _divisors(per_rank) if b <= 16] or [1]
    eps = [1]
    if m.moe:  # expert parallelism within DP x CP: a divisor of it and of the expert count
        eps = [e for e in _divisors(dp * cp) if m.num_experts % e == 0]
        eps = [e for e in eps if not s.expert_parallel or e in s.expert_parallel] or [1]
    shapes = [] if s.only_schedules else [(vp, None) for vp in vps]
    if pp > 1:
        shapes += [(get_schedule(sch).fixed_chunks, sch) for sch in s.schedules]
    for (vp, sch), b, rc, sp, ep in itertools.product(
        shapes, mbs, s.recompute, s.sequence_parallel, eps
    ):
        if not (sp and tp == 1):
            micro = max(1, gbs // (b * dp))
            etp = s.expert_tensor_parallel
            yield Layout(tp, pp, dp, b, micro, vp, rc, sp, cp, ep, etp, sch)


def layouts(cfg: MegatronConfig, s: Search) -> tuple[list[Layout], Counter]:
    """Every valid layout, and how often each rule (its flag) refused a candidate."""
    if cfg.training.global_batch_size is None:
        raise PlanError("--global-batch-size: the planner needs it. Fix: pass --global-batch-size")
    found, refused = [], Counter()
    for lay in _candidates(cfg, s):
        try:
            _check(candidate(cfg, s.world_size, lay))
        except ConfigError as e:
            refused[str(e).split(":")[0]] += 1
            continue
        found.append(lay)
    return found, refused


def plans(cfg: MegatronConfig, s: Search) -> list[Plan]:
    """Every valid layout, fitting ones first, each group by predicted step time."""
    t, gbs, out = training_of(cfg), cfg.training.global_batch_size, []
    for lay in layouts(cfg, s)[0]:
        mem = estimate_memory(cfg.model, lay, t, s.device)
        time = step_time(cfg.model, lay, t, s.hardware)
        seconds = sum(time.values())
        fits = mem.total <= s.gpu_memory_gb * GiB
        c = candidate(cfg, s.world_size, lay)
        out.append(
            Plan(lay, c, mem, time, fits, mfu(cfg.model, gbs, seconds, s.world_size, s.hardware))
        )
    return sorted(out, key=lambda p: (not p.fits, p.step_s, p.memory.total))


def _lean(s: Search, world: int) -> Search:
    """The smallest-memory corner of the search (for suggesting fixes quickly)."""
    return dataclasses.replace(
        s, world_size=world, micro_batches=(1,), recompute=("full",), interleave=False
    )


def _no_layout(cfg: MegatronConfig, s: Search, refused: Counter) -> str:
    w, gbs = s.world_size, cfg.training.global_batch_size
    rules = ", ".join(f"{flag} ({n}x)" for flag, n in refused.most_common(3))
    fixes = []
    for near in sorted(range(1, 2 * w + 2), key=lambda x: (abs(x - w), -x)):
        if near != w and layouts(cfg, _lean(s, near))[0]:
            fixes.append(f"launch {near} ranks instead of {w}")
            break
    better = -(-gbs // w) * w
    if (
        better != gbs
        and layouts(
            cfg.replace(training=dataclasses.replace(cfg.training, global_batch_size=better)),
            _lean(s, w),
        )[0]
    ):
        fixes.append(f"--global-batch-size {better} (a multiple of {w})")
    return (
        f"no parallel layout of world size {w} passes the configuration rules "
        f"(refused by: {rules}). Smallest fix: {' or '.join(fixes) or 'change the model shape'}"
    )


def _no_fit(cfg: MegatronConfig, s: Search, ranked: list[Plan]) -> str:
    small = min(ranked, key=lambda p: p.memory.total)
    need, enough = gib_above(small.memory.total, s.gpu_memory_gb)
    fixes = [f"GPUs with at least {enough} GiB ({s.memory_flag} {enough})"]
    for k in range(1, 65):
        w = s.world_size + k * s.hardware.gpus_per_node
        try:
            found = plans(cfg, dataclasses.replace(_lean(s, w), sequence_parallel=(True, False)))
        except PlanError:
            continue
        if any(p.fits for p in found):
            fixes.append(f"{w} GPUs instead of {s.world_size}")
            break
    return (
        f"no layout of {s.world_size} GPUs fits in {s.gpu_memory_gb:g} GiB: the leanest, "
        f"{small.layout.describe()}, needs {need} GiB per GPU. Smallest fix: " + " or ".join(fixes)
    )


def best_plan(cfg: MegatronConfig, s: Search) -> tuple[Plan, list[Plan]]:
    """The fastest layout that fits, and the whole ranking; PlanError names the smallest fix."""
    found, refused = layouts(cfg, s)
    if not found:
        raise PlanError(_no_layout(cfg, s, refused))
    ranked = plans(cfg, s)
    if not ranked[0].fits:
        raise PlanError(_no_fit(cfg, s, ranked))
    return ranked[0], ranked
