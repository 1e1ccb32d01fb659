"""One training step, evaluation and the native backend (our DDP, optimizer and schedules).

The model family's forward_step gives the loss of one micro batch (megatron/models/<family>/).
train_step runs the schedule over the global batch, all-reduces the gradients over DP (and the tied
embedding's over the first and last stage), and steps the optimizer and the LR schedule.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from megatron.checkpoint.async_save import AsyncSaver
from megatron.config.lr_schedule import schedule_steps
from megatron.config.rules_pipeline import overlaps_moe_pairs
from megatron.config.schema import MegatronConfig
from megatron.data_parallel.ddp import wrap_data_parallel
from megatron.data_parallel.fsdp2 import RESHARD_AFTER_FORWARD, FullyShardedModel
from megatron.fused_kernels import select_ops
from megatron.initialize import Runtime
from megatron.model.attention.sdpa import attention_report
from megatron.model.attention.varlen_cuda import varlen_report
from megatron.model.attention.window import window_report
from megatron.model.context import BuildContext
from megatron.model.moe import moe_step_stats, set_moe_loss_scale
from megatron.model.mtp import mtp_step_stats, set_mtp_loss_scale
from megatron.model.parallelize import parallelize
from megatron.mpu.grads import all_reduce_sequence_parallel_grads
from megatron.mpu.random import distributed_checkpoint
from megatron.optim.distributed import distributed_optimizer
from megatron.optim.fsdp2 import fsdp2_optimizer
from megatron.optim.plain import plain_optimizer
from megatron.resilience.fault_tolerance import ReplicaGroup, batch_share
from megatron.training.backend import (
    StepResult,
    TrainerBackend,
    average_loss,
    global_loss,
    other_losses,
)
from megatron.training.learning_rates import AnnealingLR
from megatron.training.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron.training.state import (
    TrainState,
    all_ranks_true,
    load_training_state,
    save_training_state,
)
from megatron.training.timers import Timers


def build_context(cfg: MegatronConfig, rt: Runtime, device=None) -> BuildContext:
    """This rank's BuildContext for the run: its place in the grid, the seed, device, dtype,
    dropout streams and the kernels --attention-backend etc. chose."""
    # The same kernel configs, hence the same sums, on every TP rank; a TP = 1 run after it in
    # this process autotunes again. (Importing _triton imports triton, which reads
    # TRITON_INTERPRET once: only when a kernel may run, never at this module's import.)
    if rt.state.tp_size > 1 or "megatron.fused_kernels._triton" in sys.modules:
        from megatron.fused_kernels._triton import fix_configs

        fix_configs(rt.state.tp_size > 1)
    return BuildContext(
        state=rt.state,
        seed=cfg.training.seed,
        device=device or rt.device,
        dtype=cfg.precision.params_dtype,
        rng_tracker=rt.rng_tracker,
        ops=select_ops(cfg.kernels, rt.device),
        moe_dispatcher=cfg.parallel.moe_token_dispatcher_type,
        moe_grouped_gemm=cfg.kernels.moe_grouped_gemm,
    )


def build_parallelized_model(cfg: MegatronConfig, rt: Runtime, model_provider, checkpoint_impl):
    """model_provider(ModelConfig, BuildContext) -> ModelChunks, then the run-time
    transformations in their fixed order (megatron.model.parallelize)."""
    cpu_init = cfg.distributed.use_cpu_initialization
    ctx = build_context(cfg, rt, torch.device("cpu") if cpu_init else None)
    k, dtype = cfg.kernels, cfg.precision.params_dtype
    sdpa = attention_report(cfg.model, ctx.ops, rt.state, dtype, rt.device)  # raises if unfit
    if rt.state.rank == 0:
        print(f" {ctx.ops.describe()}", file=sys.stderr, flush=True)
        if sdpa is not None:
            print(f" {sdpa}", file=sys.stderr, flush=True)
        packed = varlen_report(cfg, ctx.ops, rt.state.cp_size, dtype, rt.device)
        if packed is not None:
            print(f" {packed}", file=sys.stderr, flush=True)
        for line in window_report(cfg.model, rt.device, dtype, ctx.ops):
            print(f" {line}", file=sys.stderr, flush=True)
        if k.torch_compile:
            graphs = ", replayed as CUDA graphs" if k.enable_cuda_graph else ""
            print(
                f" torch.compile ({k.torch_compile_backend}): each model chunk as one module "
                f"(embedding, layers, head and loss){graphs}",
                file=sys.stderr,
                flush=True,
            )
    model = model_provider(cfg.model, ctx)
    if cpu_init:
        model.to(rt.device)  # --use-cpu-initialization: built on the CPU, then moved
    return parallelize(
        model,
        rt.state,
        cfg.recompute,
        torch_compile=k.torch_compile,
        compile_backend=k.torch_compile_backend,
        cuda_graph=k.enable_cuda_graph,
        checkpoint_impl=checkpoint_impl,
        precision=cfg.precision,
    )


def setup_model_and_optimizer(cfg: MegatronConfig, rt: Runtime, model_provider):
    """`model_provider(ModelConfig, BuildContext) -> ModelChunks`: the family's builder."""
    model = build_parallelized_model(cfg, rt, model_provider, recompute_impl(cfg, rt))
    dtype = cfg.precision.params_dtype
    kw = {"params_dtype": dtype, "state": rt.state, "clip_grad": cfg.training.clip_grad}
    if cfg.distributed.use_torch_fsdp2:
        model = shard_fully(model, cfg, rt)
        optimizer = fsdp2_optimizer(model, cfg.optimizer, **kw)
        return model, optimizer, make_scheduler(cfg, rt.state.dp_size, optimizer.optimizer)
    distributed = cfg.optimizer.use_distributed_optimizer
    tied = model.word_embeddings_weight() if rt.state.pp_size > 1 else None
    ddp = wrap_data_parallel(
        model,
        rt.state.dp_cp_group,  # weights are replicated over DP and CP: average over both
        cfg.distributed,
        dtype,
        use_distributed_optimizer=distributed,
        overlap_param_gather=cfg.optimizer.overlap_param_gather,
        # first and last stage must shard the tied embedding alike (see sync_embedding_grads)
        own_bucket=(tied,) if tied is not None else (),
        # MoE experts: averaged over the DP x CP / EP ranks holding the same experts
        expert_group=rt.state.expert_data_group,
    )
    if distributed:
        optimizer = distributed_optimizer(
            ddp, cfg.optimizer, overlap_param_gather=cfg.optimizer.overlap_param_gather, **kw
        )
    else:
        optimizer = plain_optimizer(
            model, cfg.optimizer, cpu_offload=cfg.deepspeed.cpu_optimizer, **kw
        )
    _, dp_size = batch_share(cfg, rt.state)  # --fault-tolerance: the replica groups
    return ddp, optimizer, make_scheduler(cfg, dp_size, optimizer.optimizer)


def shard_fully(model, cfg: MegatronConfig, rt: Runtime) -> FullyShardedModel:
    """--use-torch-fsdp2: the chunks under FSDP2 over the DP x CP ranks
    (megatron.data_parallel.fsdp2)."""
    d, dtype = cfg.distributed, cfg.precision.params_dtype
    return FullyShardedModel(
        model,
        rt.state.dp_cp_group,  # weights are replicated over DP and CP: shard over both
        params_dtype=dtype,
        reduce_dtype=dtype if d.allreduce_dtype == "params" else torch.float32,
        reshard_after_forward=RESHARD_AFTER_FORWARD[d.torch_fsdp2_reshard_after_forward],
        accumulate_unsharded=rt.state.pp_size == 1,  # the pipeline syncs every backward
    )


def recompute_impl(cfg: MegatronConfig, rt: Runtime):
    """--distribute-checkpointed-activations: the checkpoint that keeps 1/TP of each layer
    input (None: the default checkpoint)."""
    if not cfg.recompute.distribute_saved_activations:
        return None
    return functools.partial(distributed_checkpoint, group=rt.state.tp_group)


def make_scheduler(cfg: MegatronConfig, dp_size: int, optimizer) -> AnnealingLR:
    """AnnealingLR from the schedule flags; step() counts iterations or samples as they say."""
    o, t = cfg.optimizer, cfg.training
    steps = schedule_steps(o, t, t.resolved_global_batch_size(dp_size))
    scheduler = AnnealingLR(
        optimizer,
        max_lr=o.lr,
        min_lr=o.min_lr,
        init_lr=o.lr_warmup_init,
        warmup_steps=steps["warmup_steps"],
        decay_steps=steps["decay_steps"],
        decay_style=o.lr_decay_style,
        wsd_decay_steps=steps["wsd_decay_steps"],
        wsd_decay_style=o.lr_wsd_decay_style,
        override_lr_scheduler=o.override_lr_scheduler,
        use_checkpoint_lr_scheduler=o.use_checkpoint_lr_scheduler,
    )
    scheduler.default_increment = steps["increment"]
    return scheduler


def sync_embedding_grads(model, state) -> None:
    """Tied embeddings on the first and last stage: sum their gradients so both copies take
    the same step and stay equal. With the distributed optimizer the DP reduce-scatter came
    first: only this rank's shard of main_grad is reduced, which is all it reads, and the
    embedding has a bucket of its own on both stages, so both shard it alike."""
    if state.pp_size == 1 or state.embedding_group is None:
        return
    weight = model.module.word_embeddings_weight()
    if weight is not None:
        dist.all_reduce(weight.main_grad, group=state.embedding_group)


def sync_sequence_parallel_grads(model, state) -> None:
    """--sequence-parallel: norm weights, row-parallel biases and the position table saw only
    this TP rank's s / p tokens; sum their gradients over TP so every rank steps on the whole
    sequence's gradient (one all-reduce of the flattened gradients)."""
    if state.sequence_parallel:
        all_reduce_sequence_parallel_grads(model.parameters(), state.tp_group)


def _schedule(cfg: MegatronConfig, rt: Runtime):
    return get_forward_backward_func(
        rt.state,
        micro_batch_size=cfg.training.micro_batch_size,
        seq_length=cfg.model.seq_length // rt.state.cp_size,  # this CP rank's chunks
        hidden_size=cfg.model.hidden_size,
        dtype=cfg.precision.params_dtype,
        schedule=cfg.parallel.resolved_pipeline_schedule,
        overlap=overlaps_moe_pairs(cfg),
    )


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    scheduler,
    num_micro_batches,
    rt: Runtime,
    timers: Timers,
    schedule=None,
    replicas=None,
) -> StepResult:
    """One optimizer step over the global batch; returns the loss, whether it updated, norm.
    `replicas` (--fault-tolerance, megatron.resilience.fault_tolerance.ReplicaGroup): the
    gradients are averaged over the live replica groups too, and the step is taken only when
    they all commit it (else `committed` is False and nothing changed)."""
    model.zero_grad_buffer()
    # MoE aux / z losses get the LM loss's gradient scale (1 / micro batches x loss scale, x CP
    # as the LM loss: each CP rank backpropagates its share, gradients are averaged over CP)
    scale = float(optimizer.scale_loss(torch.ones(()))) * rt.state.cp_size / num_micro_batches
    set_moe_loss_scale(model, scale)
    set_mtp_loss_scale(model, scale)  # the multi-token prediction losses' likewise
    schedule = schedule or forward_backward_no_pipelining
    stats = schedule(
        forward_step_func,
        data_iterator,
        model,
        num_micro_batches,
        scale_loss=optimizer.scale_loss,
        timers=timers,
    )
    timers("grads-all-reduce", 2).start()
    model.finish_grad_sync()
    sync_embedding_grads(model, rt.state)
    # After the DP reduction, before optimizer.step() (inf/NaN check, norm, clipping). With
    # --use-distributed-optimizer only this rank's shards are DP-reduced here; TP peers share
    # the buffer layout, hence own the same ranges, so the TP sum is right where it is read.
    sync_sequence_parallel_grads(model, rt.state)
    timers("grads-all-reduce", 2).stop()
    # Equal on every rank and still on the device: a non-finite one skips the step, decided
    # together with the gradients' inf/NaN check in the optimizer's one host read.
    loss = global_loss([s["lm loss"] for s in stats], rt)
    if replicas is not None:
        loss, committed = replicas.average_and_commit(model.grad_buffer, loss)
        if not committed:
            return {"lm_loss": loss, "updated": False, "grad_norm": None, "committed": False}
    timers("optimizer", 1).start()
    updated, grad_norm = optimizer.step(loss=loss)
    timers("optimizer", 1).stop()
    # by its default_increment: 1 iteration, or the global batch. A device flag (the skip
    # decided on the device) is not read here: the schedule steps, and the loop takes it back
    # when it reads a skip (TrainerBackend.take_back_schedule).
    if isinstance(updated, torch.Tensor) or updated:
        scheduler.step()
    result = {"lm_loss": loss, "updated": updated, "grad_norm": grad_norm}
    if replicas is not None:
        result["replicas"] = replicas.took_part
    others = other_losses(forward_step_func, stats, rt)
    # {} without MoE; the expert biases move here, after the optimizer step (not if skipped)
    others.update(moe_step_stats(model, rt.state, _model_config(model), updated))
    others.update(mtp_step_stats(model, rt.state, _model_config(model)))  # {} without MTP
    return {**result, "other_losses": others} if others else result


def _model_config(model):
    chunk = getattr(model, "module", model)
    chunk = chunk[0] if hasattr(chunk, "chunks") else chunk
    return chunk.cfg


@torch.no_grad()
def evaluate(
    forward_step_func, data_iterator, model, eval_iters, num_micro_batches, rt, schedule=None
) -> float:
    model.eval()
    schedule = schedule or forward_backward_no_pipelining
    stats = []
    for _ in range(eval_iters):
        stats += schedule(
            forward_step_func, data_iterator, model, num_micro_batches, forward_only=True
        )
    model.train()
    return average_loss([s["lm loss"] for s in stats], rt)


class NativeBackend(TrainerBackend):
    """Our own TP x PP x DP: DistributedDataParallel, MegatronOptimizer (megatron.optim), our
    schedules."""

    def __init__(self, cfg: MegatronConfig, rt: Runtime, forward_step_func, model_provider):
        self.cfg, self.rt, self.forward_step = cfg, rt, forward_step_func
        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(
            cfg, rt, model_provider
        )
        self.schedule = _schedule(cfg, rt)
        self.saver = AsyncSaver(rt.device) if cfg.checkpoint.async_save else None
        self.replicas = None  # --fault-tolerance: torchft's replica groups
        if cfg.parallel.fault_tolerance:
            self.replicas = ReplicaGroup(cfg, rt, self.model, self.optimizer, self.scheduler)

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    def train_step(self, data_iterator, num_micro_batches: int, timers: Timers) -> StepResult:
        if self.saver is not None and self.saver.pending:  # an --async-save to commit?
            self.saver.poll(lambda mine: all_ranks_true(mine, self.rt.device))
        step = functools.partial(
            train_step,
            self.forward_step,
            data_iterator,
            self.model,
            self.optimizer,
            self.scheduler,
            num_micro_batches,
            self.rt,
            timers,
            self.schedule,
        )
        if self.replicas is None:
            return step()
        try:
            return step(replicas=self.replicas)
        except Exception as e:  # this group's forward/backward raised: every group drops the step
            loss, _ = self.replicas.discard_step(e, self.model.grad_buffer)
            return {"lm_loss": loss, "updated": False, "grad_norm": None, "committed": False}

    def evaluate(self, data_iterator, eval_iters: int, num_micro_batches: int) -> float:
        return evaluate(
            self.forward_step,
            data_iterator,
            self.model,
            eval_iters,
            num_micro_batches,
            self.rt,
            self.schedule,
        )

    def save(self, state: TrainState) -> bool:
        if self.saver is not None:
            self.saver.wait()  # at most one save in flight
        save_training_state(
            self.cfg, self.rt, self.model, self.optimizer, self.scheduler, state, self.saver
        )
        return self.saver is None  # --async-save: staged now, committed at a later step

    def committed_saves(self) -> list[int]:
        return self.saver.take_committed() if self.saver is not None else []

    def wait_for_save(self) -> None:
        if self.saver is not None:
            self.saver.wait()

    def load(self) -> TrainState:
        return load_training_state(self.cfg, self.rt, self.model, self.optimizer, self.scheduler)
