"""Rules only a training run needs (pretrain_gpt2.py / pretrain_bert.py check them at start-up):
batch sizes and ramp-up, the learning-rate schedule, loss scaling, saving, the interleaved
schedule's micro-batch rounds."""

from __future__ import annotations

from megatron.config.declare import check_requires, fail
from megatron.config.lr_schedule import schedule_steps
from megatron.config.optimizers import get_kind
from megatron.config.rules_logging import validate_logging
from megatron.config.schema import MegatronConfig
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.config.schema_training import TrainingConfig
from megatron.config.tokenizer_files import validate_vocab


def validate_batch(t: TrainingConfig, dp: int) -> None:
    gbs = t.resolved_global_batch_size(dp)
    if gbs % (t.micro_batch_size * dp):
        fail(
            "--global-batch-size",
            f"{gbs} is not divisible by --micro-batch-size {t.micro_batch_size} "
            f"x data-parallel size {dp}",
            f"use a multiple of {t.micro_batch_size * dp}",
        )


def validate_training(cfg: MegatronConfig) -> None:
    """The rules that only a training run needs (pretrain_gpt2.py checks them at start-up)."""
    t, o, c = cfg.training, cfg.optimizer, cfg.checkpoint
    if (t.train_iters is None) == (t.train_samples is None):
        fail(
            "--train-iters/--train-samples",
            "give exactly one of them",
            "pass --train-iters N (steps) or --train-samples N (samples)",
        )
    validate_logging(cfg.logging, cfg.parallel.world_size, cfg.deepspeed.enabled)
    if o.lr is None:
        fail("--lr", "a positive peak learning rate is required", "pass e.g. --lr 1.5e-4")
    if o.min_lr > o.lr:
        fail("--min-lr", f"{o.min_lr} is not in [0, --lr {o.lr}]", "lower --min-lr")
    if o.lr_warmup_init > o.lr:
        fail("--lr-warmup-init", f"{o.lr_warmup_init} is above --lr {o.lr}", "lower it")
    _validate_lr_schedule(o, t, cfg.parallel.data_parallel_size)
    if o.override_lr_scheduler and o.use_checkpoint_lr_scheduler:
        fail(
            "--override-lr-scheduler",
            "given with --use-checkpoint-lr-scheduler",
            "choose which schedule wins on resume",
        )
    if o.initial_loss_scale < o.min_loss_scale:
        fail(
            "--initial-loss-scale/--min-loss-scale",
            "need 0 < min <= initial",
            "e.g. --initial-loss-scale 65536 --min-loss-scale 1",
        )
    if c.save_interval is not None and c.save is None:
        fail("--save-interval", "given without --save", "pass --save DIR")
    if c.async_save and c.save is None:
        fail("--async-save", "given without --save", "pass --save DIR")
    if c.async_save and cfg.deepspeed.enabled:
        fail(
            "--async-save",
            "--deepspeed's engine writes its own checkpoints, synchronously",
            "drop --async-save (or --deepspeed)",
        )
    _validate_rampup(t, cfg.parallel.data_parallel_size)
    _validate_interleaved(cfg)
    _validate_whole_matrices(cfg)
    validate_vocab(cfg)


def _validate_whole_matrices(cfg: MegatronConfig) -> None:
    """An optimizer of whole matrices (Muon) runs in our own optimizers (plain,
    --use-distributed-optimizer and --use-torch-fsdp2); the settings that require an optimizer
    (Muon's) mean nothing to another one (their declarations say so)."""
    check_requires(cfg)
    name = cfg.optimizer.optimizer
    if not get_kind(name).whole_matrices:
        return
    clash = (
        ("--deepspeed", cfg.deepspeed.enabled, "DeepSpeed's engine builds its own optimizer"),
        (
            "--cpu-optimizer",
            cfg.deepspeed.cpu_optimizer,
            "Muon all-gathers TP-split matrices where the gradients are, not on the CPU",
        ),
    )
    for flag, given, why in clash:
        if given:
            fail(
                f"--optimizer {name}",
                f"given with {flag}: {why}",
                f"use --optimizer adam with {flag}, or drop {flag}",
            )
    etp = cfg.parallel.expert_tp_size
    if cfg.model.moe and etp > 1:  # each expert is orthogonalised whole on its EP rank
        fail(
            f"--optimizer {name}",
            f"given with --num-experts at --expert-tensor-parallel-size {etp} (its default is "
            "--tensor-model-parallel-size): experts split over ETP are not gathered for "
            "Newton-Schulz",
            "pass --expert-tensor-parallel-size 1, or use --optimizer adam",
        )


def _validate_interleaved(cfg: MegatronConfig) -> None:
    """The interleaved schedule runs whole rounds of P micro batches, at every batch size of
    the run (the --rampup-batch-size steps included)."""
    par, t = cfg.parallel, cfg.training
    if par.num_layers_per_virtual_pipeline_stage is None or not par.schedule.whole_rounds:
        return  # the others run any number of micro batches (megatron.schedules.sim)
    dp, pp = par.data_parallel_size, par.pipeline_model_parallel_size
    unit = t.micro_batch_size * dp
    sizes = [t.resolved_global_batch_size(dp)]
    if t.rampup_batch_size is not None:
        sizes += list(t.rampup_batch_size[:2])  # START and INCREMENT
    for size in sizes:
        if (size // unit) % pp:
            fail(
                "--num-layers-per-virtual-pipeline-stage",
                f"the interleaved schedule needs the number of micro batches per step "
                f"({size // unit} = batch {size} / (micro batch x DP)) to be a multiple of "
                f"--pipeline-model-parallel-size {pp}",
                "change --global-batch-size, --rampup-batch-size or --micro-batch-size",
            )


def _validate_rampup(t: TrainingConfig, dp: int) -> None:
    if t.rampup_batch_size is None:
        return
    start, incr, samples = t.rampup_batch_size
    unit = t.micro_batch_size * dp
    gbs = t.resolved_global_batch_size(dp)
    if t.train_samples is None:
        fail(
            "--rampup-batch-size",
            "a batch-size ramp needs sample-based training",
            "use --train-samples (and --lr-decay-samples) instead of --train-iters",
        )
    if start < 1 or incr < 1 or samples < 0 or start > gbs or (gbs - start) % incr:
        fail(
            "--rampup-batch-size",
            f"{start} {incr} {samples} does not step from START to "
            f"--global-batch-size {gbs} in whole INCREMENTs",
            "adjust START or INCREMENT",
        )
    if start % unit or incr % unit:
        fail(
            "--rampup-batch-size",
            f"START and INCREMENT must be multiples of micro-batch x DP = {unit}",
            f"use multiples of {unit}",
        )


def _validate_lr_schedule(o: OptimizerConfig, t: TrainingConfig, dp: int) -> None:
    """The schedule flags: one mode (iterations or samples), one way to give the warmup, and
    lengths AnnealingLR can run (warmup shorter than the decay, WSD's anneal inside it)."""
    unit, other = ("iters", "samples") if t.train_iters is not None else ("samples", "iters")
    for stem in ("lr-decay", "lr-warmup", "lr-wsd-decay"):
        if getattr(o, f"{stem.replace('-', '_')}_{other}"):
            fail(f"--{stem}-{other}", f"contradicts --train-{unit}", f"use --{stem}-{unit}")
    if o.warmup is not None and o.lr_warmup_fraction is not None:
        fail("--warmup", "is the classic --lr-warmup-fraction; both are given", "pass one of them")
    fraction_flag = "--warmup" if o.warmup is not None else "--lr-warmup-fraction"
    if (o.lr_warmup_fraction is not None or o.warmup is not None) and o.lr_warmup_iters:
        fail(fraction_flag, "given together with --lr-warmup-iters", "set the warmup one way")
    if (o.lr_warmup_fraction is not None or o.warmup is not None) and o.lr_warmup_samples:
        fail(fraction_flag, "given together with --lr-warmup-samples", "set the warmup one way")
    steps = schedule_steps(o, t, t.resolved_global_batch_size(dp))
    warm, decay, wsd = steps["warmup_steps"], steps["decay_steps"], steps["wsd_decay_steps"]
    if o.lr_decay_style != "constant" and warm >= decay:
        fail(
            f"--lr-warmup-{unit}/--lr-warmup-fraction",
            f"{warm} warmup steps are not fewer than the {decay} decay steps "
            f"(--lr-decay-{unit}, default --train-{unit})",
            "shorten the warmup or lengthen the decay (or use --lr-decay-style constant)",
        )
    if o.lr_decay_style == "WSD" and not (wsd is not None and 0 < wsd <= decay - warm):
        fail(
            f"--lr-wsd-decay-{unit}",
            f"--lr-decay-style WSD needs it in (0, decay - warmup = {decay - warm}], got {wsd}",
            f"pass --lr-wsd-decay-{unit} within that range",
        )
