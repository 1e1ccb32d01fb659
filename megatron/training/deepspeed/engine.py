"""--deepspeed: the same model, optimizer and schedule handed to a DeepSpeed engine.

- PP = 1: the model (our TP layers) in `deepspeed.initialize` with our torch AdamW, AnnealingLR
  and an `mpu` adapter over our process groups, so ZeRO partitions over DP only.
- PP > 1: the family's `deepspeed.pipe.PipelineModule` built from the same layers
  (megatron/models/gpt/deepspeed_pipe.py), trained with `train_batch`.
- Activation recompute through `deepspeed.checkpointing` (partitioning, CPU offload, ...) with
  our TP dropout stream replayed on recompute.
- Document options (--reset-position-ids / --reset-attention-mask): the pipeline layers pass
  (hidden, position ids, document ids) from stage to stage instead of the hidden states alone.
- --sequence-parallel: the engine reduces and steps inside its own backward()/step(), so the
  gradients of the parameters that see s / TP tokens are summed over TP by a hook on each
  fresh gradient, before DeepSpeed accumulates it (ZeRO 0-2; ZeRO-3 is refused by the config).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from megatron.config.declare import ConfigError
from megatron.config.deepspeed_json import build_ds_config, uses_deepspeed_checkpointing
from megatron.config.optimizers import get_kind
from megatron.config.schema import MegatronConfig
from megatron.model.moe import moe_step_stats, set_moe_loss_scale
from megatron.model.mtp import mtp_step_stats, set_mtp_loss_scale
from megatron.mpu.grads import reduce_sequence_parallel_grads_in_backward
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.random import checkpoint
from megatron.optim.build import build_torch_optimizer, param_groups
from megatron.training.backend import global_loss, other_losses
from megatron.training.data import get_batch
from megatron.training.deepspeed.moe import (
    count_experts_once_when_clipping,
    expert_parallel_model,
    prepare_experts,
    split_expert_param_groups,
)
from megatron.training.schedules import forward_backward_no_pipelining
from megatron.training.step import _model_config, build_parallelized_model, evaluate


def import_deepspeed():
    try:
        import deepspeed
    except ImportError:
        raise ImportError(
            "--deepspeed needs DeepSpeed: pip install --no-build-isolation deepspeed "
            "(after torch is installed)"
        ) from None
    return deepspeed


def _skip_shared_memory_all_reduce(deepspeed) -> None:
    """On the CPU accelerator, DeepSpeed's comm layer JIT-compiles its shared-memory all-reduce
    op (deepspeed_shm_comm: two C++ files, ~30-60 s of both cores of a small machine, again
    whenever another environment rebuilt the shared torch_extensions cache) at
    init_distributed. Its only user is deepspeed.comm.inference_all_reduce, which the trainer
    never calls (gradients go through the engine's and our torch.distributed collectives), so
    it is marked incompatible here and DeepSpeed falls back to the process group, as on a
    machine without a compiler."""
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


class MpuAdapter:
    """The `mpu` object DeepSpeed asks for, answered from our ParallelState. DeepSpeed's "model
    parallel" is our tensor parallel (pipeline parallelism runs inside DeepSpeed or not at all)."""

    def __init__(self, state: ParallelState):
        self.s = state

    def get_model_parallel_group(self):
        return self.s.tp_group

    def get_model_parallel_rank(self):
        return self.s.tp_rank

    def get_model_parallel_world_size(self):
        return self.s.tp_size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self.s.tp_src_rank

    def get_data_parallel_group(self):
        return self.s.dp_group

    def get_data_parallel_rank(self):
        return self.s.dp_rank

    def get_data_parallel_world_size(self):
        return self.s.dp_size

    def get_data_parallel_group_ranks(self):
        return list(self.s.dp_ranks)

    def get_pipeline_model_parallel_group(self):
        return self.s.pp_group

    def get_pipeline_model_parallel_rank(self):
        return self.s.pp_rank

    def get_pipeline_model_parallel_world_size(self):
        return self.s.pp_size


def _checkpoint_fn(cfg: MegatronConfig, rt):
    """(impl, tracked): the checkpoint implementation for recompute and that checkpoint with our
    TP dropout stream replayed. DeepSpeed's (deepspeed.checkpointing, configured from the
    flags) with --deepspeed-activation-checkpointing or one of its options, as v1.x did;
    otherwise our mpu checkpoint (impl None)."""
    impl = None
    if uses_deepspeed_checkpointing(cfg):
        deepspeed = import_deepspeed()
        d = cfg.deepspeed
        if d.checkpoint_in_cpu and not d.partition_activations and rt.device.type == "cpu":
            raise ConfigError(
                "--checkpoint-in-cpu: the activations already live on the CPU here, and "
                "DeepSpeed's CPU checkpointing without partitioning loses the saved layer input "
                "when the device is the CPU. Fix: drop it, or add --partition-activations"
            )
        deepspeed.checkpointing.configure(
            MpuAdapter(rt.state),
            partition_activations=d.partition_activations,
            contiguous_checkpointing=d.contigious_checkpointing,
            num_checkpoints=-(-cfg.model.num_layers // cfg.recompute.num_layers),
            checkpoint_in_cpu=d.checkpoint_in_cpu,
            synchronize=d.synchronize_each_layer,
            profile=d.profile_backward,
        )
        impl = deepspeed.checkpointing.checkpoint

    def tracked(function, *args):
        return checkpoint(function, rt.rng_tracker, *args, impl=impl)

    return impl, tracked


def _client_optimizer(groups: list[dict], cfg: MegatronConfig):
    """Our AdamW/SGD, or with --cpu-optimizer (ZeRO offload) DeepSpeed's CPU Adam kernel in
    AdamW mode (--cpu_torch_adam: torch's AdamW, which DeepSpeed is told to accept)."""
    d, o = cfg.deepspeed, cfg.optimizer
    if (
        not d.cpu_optimizer
        or d.cpu_torch_adam
        or "adam" not in get_kind(o.optimizer).deepspeed_types
    ):
        return build_torch_optimizer(groups, o)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    for g in groups:
        g["weight_decay"] = o.weight_decay * g["wd_mult"]
    return DeepSpeedCPUAdam(
        groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, adamw_mode=True
    )


def setup_deepspeed(
    cfg: MegatronConfig, rt, make_scheduler, model_provider, pipeline_provider=None
):
    """(engine, scheduler, is_pipeline): the model, our optimizer and LR schedule in DeepSpeed.
    `model_provider`: the family's builder; `pipeline_provider(cfg, rt, checkpoint_fn)`: its
    PipelineModule for PP > 1 (None: the family has none)."""
    deepspeed = import_deepspeed()
    # Our process group already exists; DeepSpeed's comm layer adopts it. DeepSpeed also insists
    # on LOCAL_RANK, which a launcher other than torchrun/deepspeed may not set.
    os.environ.setdefault("LOCAL_RANK", str(rt.device.index or 0))
    if rt.device.type == "cpu":
        _skip_shared_memory_all_reduce(deepspeed)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    ds_config = build_ds_config(cfg)
    impl, tracked = _checkpoint_fn(cfg, rt)
    pipeline = rt.state.pp_size > 1
    if pipeline and pipeline_provider is None:
        raise ValueError(
            "--deepspeed with --pipeline-model-parallel-size > 1: this model family has no "
            "DeepSpeed PipelineModule. Fix: drop --deepspeed (our pipeline runs this model) or "
            "use --pipeline-model-parallel-size 1"
        )
    if pipeline:
        model = pipeline_provider(cfg, rt, tracked)
    else:
        model = build_parallelized_model(cfg, rt, model_provider, impl)
        if ds_config["zero_optimization"]["stage"] == 3 and model[0].tied:
            # The head reads the embedding's weight outside the module that owns it.
            deepspeed.zero.register_external_parameter(
                model[0].head, model[0].word_embeddings_weight()
            )
    if rt.state.sequence_parallel:
        reduce_sequence_parallel_grads_in_backward(model.parameters(), rt.state.tp_group)
    experts = not pipeline and expert_parallel_model(model, rt.state)
    groups = param_groups(model)
    if experts:  # DeepSpeed reduces, partitions and norms them over our expert groups
        prepare_experts(model, rt.state)
        groups = split_expert_param_groups(groups)
    optimizer = _client_optimizer(groups, cfg)
    scheduler = make_scheduler(optimizer)
    with _no_warm_up_step(optimizer, ds_config):
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config,
            mpu=None if pipeline else MpuAdapter(rt.state),
            dist_init_required=False,
        )
    if engine.optimizer is optimizer:  # fp32 without ZeRO: DeepSpeed steps ours unwrapped
        _skip_non_finite_steps(optimizer)
        if experts:
            count_experts_once_when_clipping(engine, optimizer, rt.state)
    if pipeline and ds_config.get("wall_clock_breakdown"):
        _tolerate_restarted_backward_timers(engine)
    return engine, scheduler, pipeline


@contextlib.contextmanager
def _no_warm_up_step(optimizer, ds_config: dict):
    """Around deepspeed.initialize: undo the warm-up step of DeepSpeed's fp16/bf16 wrappers
    without ZeRO (FP16_Optimizer, FP16_UnfusedOptimizer: fp16 or bf16 at ZeRO-0). Their
    constructor steps our optimizer once with zero gradients to create its states, so Adam's
    first real update would be its step 2: with m = (1 - b1) g and v = (1 - b2) g^2 the bias
    corrections 1 - b^2 give m_hat = g / (1 + b1), v_hat = g^2 / (1 + b2), an update ~0.74 of
    ours at b1 0.9, b2 0.999. That step runs at LR 0 here (AdamW would otherwise decay the
    fp32 master weights once, and not the model's copy), and the states it made are dropped:
    the first training step is step 1, as in our backend. ZeRO 1-3 and DeepSpeed's
    BF16_Optimizer create their states without a step."""
    if ds_config["zero_optimization"]["stage"] != 0:
        yield
        return
    lrs = [(group, group["lr"]) for group in optimizer.param_groups]
    for group, _ in lrs:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, lr in lrs:
            group["lr"] = lr
    optimizer.state.clear()  # torch's optimizers create their states again at the first step


def _skip_non_finite_steps(optimizer) -> None:
    """Promise 5 where DeepSpeed has no check of its own: its fp16/bf16 and ZeRO optimizers skip a
    step whose gradients hold inf/NaN, but in fp32 without ZeRO the engine calls our optimizer's
    step() directly. Before each step one scalar all-reduce (MAX over every rank: the DP replicas
    agree already, the TP/PP shards differ) asks whether any gradient is non-finite; if so no
    rank steps, and `overflow` (what the engine reads after step()) tells it to count the skip
    (`was_step_applied()` False) and leave the LR schedule where it is."""
    step = optimizer.step
    optimizer.overflow = False

    def guarded_step(closure=None):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:  # one flag per tensor, one device sync in all
            bad = torch.stack([g.isfinite().all().logical_not() for g in grads]).any()
            bad = bad.float().reshape(1)
        else:  # on the parameters' device: NCCL reduces no CPU tensor
            params = [p for g in optimizer.param_groups for p in g["params"]]
            bad = torch.zeros(1, device=params[0].device if params else None)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        optimizer.overflow = bool(bad.item())
        return None if optimizer.overflow else step(closure)

    optimizer.step = guarded_step


def _tolerate_restarted_backward_timers(engine) -> None:
    """wall_clock_breakdown under DeepSpeed's pipeline engine (0.19): a stage starts its backward
    timers in _exec_backward_pass, then the engine's output hook starts (and later stops) the
    same timers again, which asserts. Make those timers' start/stop idempotent, so the breakdown
    is measured (from the first start to the first stop) instead of crashing."""
    t = engine.engine_timers
    for name in {*t.backward_timers, *t.backward_inner_timers, *t.backward_reduce_timers}:
        timer = engine.timers(name)
        start, stop = timer.start, timer.stop

        def tolerant_start(timer=timer, start=start):
            if not timer.started_:
                start()

        def tolerant_stop(reset=False, record=False, timer=timer, stop=stop):
            if timer.started_:
                stop(reset=reset, record=record)

        timer.start, timer.stop = tolerant_start, tolerant_stop


class PipeBatches:
    """Our micro batches (get_batch) as the (inputs, (labels, loss_mask)) pairs DeepSpeed's
    pipeline engine pulls, as many per step as its gradient accumulation steps.

    inputs: the tokens; or, when the batch has position or document ids, (tokens, position_ids,
    document_ids), the engine sending only tensors: absent positions are 0..s-1 (what the model
    uses without them) and absent document ids 0 (unused: the layers then build no mask)."""

    def __init__(self, data_iterator, device):
        self.source, self.device = data_iterator, device

    def __iter__(self):
        return self

    def __next__(self):
        batch = get_batch(self.source, self.device)
        targets = (batch.labels, batch.loss_mask)
        if batch.position_ids is None and batch.document_ids is None:
            return batch.tokens, targets
        tokens = batch.tokens
        positions = batch.position_ids
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        documents = batch.document_ids
        if documents is None:
            documents = torch.zeros_like(tokens)
        return (tokens, positions.contiguous(), documents), targets


def ds_train_step(
    engine, pipeline, forward_step_func, data_iterator, num_micro_batches, rt, timers=None
) -> dict:
    """One global batch. The LR schedule steps by its default_increment (iterations/samples).

    PP > 1: the pipeline engine's train_batch, whose loss DeepSpeed already averages over DP
    and sends to every stage. PP = 1: our micro-batch loop driving the engine, and the loss
    averaged as the native backend does."""
    others = {}
    if pipeline:
        value = engine.train_batch(PipeBatches(data_iterator, rt.device)).detach().reshape(())
    else:
        # MoE aux / z losses: the LM loss's gradient scale (1 / micro batches x fp16 scale)
        fp16_scale = engine.optimizer.loss_scale if engine.fp16_enabled() else 1.0
        set_moe_loss_scale(engine.module, float(fp16_scale) / num_micro_batches)
        set_mtp_loss_scale(engine.module, float(fp16_scale) / num_micro_batches)
        stats = forward_backward_no_pipelining(
            forward_step_func, data_iterator, engine, num_micro_batches, timers=timers, engine=True
        )
        value = global_loss([s["lm loss"] for s in stats], rt)
        others = other_losses(forward_step_func, stats, rt)
    norm, updated = engine.get_global_grad_norm(), bool(engine.was_step_applied())
    if not pipeline:  # the expert biases move after the engine's step, unless it skipped it
        others.update(moe_step_stats(engine.module, rt.state, _model_config(engine), updated))
        others.update(mtp_step_stats(engine.module, rt.state, _model_config(engine)))
    result = {
        "lm_loss": value,
        "updated": updated,
        "grad_norm": None if norm is None or not updated else float(norm),
    }
    return {**result, "other_losses": others} if others else result


@torch.no_grad()
def ds_evaluate(
    engine, pipeline, forward_step_func, data_iterator, eval_iters, num_micro_batches, rt
) -> float:
    """PP > 1: the pipeline engine's eval_batch; PP = 1: the native evaluate over the engine."""
    if not pipeline:
        schedule = functools.partial(forward_backward_no_pipelining, engine=True)
        return evaluate(
            forward_step_func, data_iterator, engine, eval_iters, num_micro_batches, rt, schedule
        )
    engine.eval()
    values = [
        float(engine.eval_batch(PipeBatches(data_iterator, rt.device)).item())
        for _ in range(eval_iters)
    ]
    engine.train()
    return sum(values) / len(values)
